"""metrics.jsonl and TensorBoard: every metric of a record reaches both."""

import importlib.util
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from jaxreplay.train.accounting import STALENESS_EDGES, TIMES_SAMPLED_EDGES, histogram
from jaxreplay.train.metrics import MetricsWriter, read_metrics


def tensorboard_values(run_dir) -> dict[tuple[str, int], object]:
    """(tag, step) -> the summary value in the run's TensorBoard event files (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    values = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                values[(v.tag, event.step)] = v
    return values


def test_scalars_and_histograms_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")
    staleness, times = np.array([0, 0, 1, 3, 300]), np.array([1, 1, 2, 5])
    writer = MetricsWriter(tmp_path)
    writer.write(1, {"loss": 0.5, "learning_rate": 3e-4, "staleness/hist": histogram(staleness, STALENESS_EDGES),
                     "replay/times_sampled_hist": histogram(times, TIMES_SAMPLED_EDGES)})
    writer.close()
    assert read_metrics(tmp_path)[0]["staleness/hist"] == [2, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    tb = tensorboard_values(tmp_path)
    assert tb[("loss", 1)].simple_value == 0.5
    assert tb[("learning_rate", 1)].simple_value == pytest.approx(3e-4)
    histo = tb[("staleness/hist", 1)].histo
    assert list(histo.bucket) == [2, 1, 1, 0, 0, 0, 0, 0, 0, 1] and histo.num == 5
    # Bucket i holds the integers up to its limit: 0 | 1 | 2-3 | ... | 256+.
    assert list(histo.bucket_limit)[:3] == [0.5, 1.5, 3.5] and histo.min == 0 and histo.max > 256
    assert list(tb[("replay/times_sampled_hist", 1)].histo.bucket) == [2, 1, 0, 1, 0, 0, 0, 0, 0]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["replay/times_sampled_hist"][0] == 2


@pytest.mark.needs_torch
def test_writing_metrics_does_not_import_torch_where_it_is_installed(tmp_path):
    """tensorboardX imports torch whenever it can (seconds of every run's start-up on GPU
    images and Colab, which ship torch); a run's metrics never need it."""
    pytest.importorskip("tensorboardX")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: nothing would import it")
    script = ("import sys\n"
              "import jaxreplay.train.driver\n"
              "from jaxreplay.train.metrics import MetricsWriter\n"
              "writer = MetricsWriter(sys.argv[1])\n"
              "writer.write(1, {'loss': 0.5})\n"
              "writer.close()\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert tensorboard_values(tmp_path)[("loss", 1)].simple_value == 0.5
