"""gcp-storage-emulator as the tests run it, mended where it differs from real GCS.

- Reads: GCS answers a media download with x-goog-generation and x-goog-metageneration;
  tensorstore (under Orbax) reads them to rewrite an OCDBT manifest conditionally.
  gcp-storage-emulator 2026.7.19 leaves them out, and Orbax's saves then fail at random with
  "Malformed StorageGeneration". This adds them to its download handler.
- Multipart uploads: gcsfs ends an upload's content with "\\n--boundary". The emulator parses the
  body with the email package, which takes a CRLF before a boundary as the delimiter's line break,
  so an object whose last byte is "\\r" (1 in 256 binary files: an OCDBT manifest, once) lost it.
  This splits the body on the delimiter with the line break the body itself uses.

Then it runs the emulator's command line: `python gcs_server.py -d DATA start ...`.
"""

import json
import sys
from email.parser import BytesHeaderParser

from gcp_storage_emulator import server
from gcp_storage_emulator.handlers import objects

_download = objects.download
_read_data = server._read_data


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    if response.status.value in (200, 206):
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])


def read_data(request_handler, query):
    """A multipart/related upload split exactly (RFC 2046: the line break before a delimiter is
    the delimiter's); every other body as the emulator reads it."""
    content_type = request_handler.headers.get("Content-Type") or ""
    if not content_type.startswith("multipart/related"):
        return _read_data(request_handler, query)
    body = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
    headers = BytesHeaderParser()
    boundary = headers.parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode()).get_param("boundary")
    delimiter = b"--" + boundary.encode()
    first = body.index(delimiter) + len(delimiter)
    newline = b"\r\n" if body[first:].startswith(b"\r\n") else b"\n"
    meta, content = (part[len(newline):].split(newline * 2, 1) for part in body[first:].split(newline + delimiter)[:2])
    return {"meta": json.loads(meta[1]), "content": content[1],
            "content-type": headers.parsebytes(content[0] + newline * 2).get_content_type()}


objects.download = download  # before the server module reads its routes
server._read_data = read_data

from gcp_storage_emulator.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
