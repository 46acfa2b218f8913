"""gcp-storage-emulator as the tests run it: with the headers real GCS sends on object reads.

GCS answers a media download with x-goog-generation and x-goog-metageneration; tensorstore (under
Orbax) reads them to rewrite an OCDBT manifest conditionally. gcp-storage-emulator 2026.7.19 leaves
them out, and Orbax's saves then fail at random with "Malformed StorageGeneration". This adds them
to its download handler, then runs its command line: `python gcs_server.py -d DATA start ...`.
"""

import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    if response.status.value in (200, 206):
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])


objects.download = download  # before the server module reads its routes

from gcp_storage_emulator.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
