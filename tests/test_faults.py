"""Faults found by outside testing (issue 33), each on real files, real processes and real sockets:
damaged datasets, an embedding larger than the tokenizer, a resume refused, the coordinator's
listening address. Each names what went wrong in one line, or no longer goes wrong."""

import json

import jax
import numpy as np
import pytest

from jaxreplay.config import load_config
from jaxreplay.learn.scoring import sequence_scores
from jaxreplay.models.transformer import score_hidden
from jaxreplay.rollout.rollouts import to_device_batch
from jaxreplay.tasks.base import ByteTokenizer
from jaxreplay.tasks.datasets import DatasetError
from jaxreplay.tasks.registry import make_task

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
         "model.d_ff=64"]
GOOD = json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n"


def dataset_task(directory, fmt: str):
    return make_task(load_config(None, [f"task.name={fmt}", f"task.path={directory}/{{split}}.{fmt}",
                                        "warmstart.steps=0", "model.vocab_size=260", "task.max_prompt_len=8"]).task)


def jsonl_task(directory, train: bytes):
    (directory / "train.jsonl").write_bytes(train)
    (directory / "test.jsonl").write_text(GOOD)
    return dataset_task(directory, "jsonl")


def parquet_task(directory, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), directory / "train.parquet")
    pq.write_table(pa.table({"prompt": ["1+2="], "answer": ["3"]}), directory / "test.parquet")
    return dataset_task(directory, "parquet")


# ----------------------------------------------------------------------------------
# Damaged datasets: one DatasetError (exit 2 from the CLI) naming the file and the line or row


def test_a_jsonl_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: not UTF-8 text \(byte 0xff at column 13\)"):
        jsonl_task(tmp_path, GOOD.encode() + b'{"prompt": "\xff", "answer": "1"}\n')


def test_json_nested_too_deeply_is_named_by_file_and_line(tmp_path):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "answer": "1"}\n'
    with pytest.raises(DatasetError, match=r"train\.jsonl:3: JSON nested too deeply"):
        jsonl_task(tmp_path, GOOD.encode() * 2 + deep)


def test_a_binary_parquet_column_where_text_is_expected_is_named_by_file_and_row(tmp_path):
    with pytest.raises(DatasetError, match=r"train\.parquet: row 1: binary data where text is expected"):
        parquet_task(tmp_path, {"prompt": [b"1+2=", b"\x89PNG\r\n\x1a\n"], "answer": ["3", "4"]})


def test_a_garbage_parquet_file_is_named(tmp_path):
    (tmp_path / "train.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 8 + b"PAR1")
    (tmp_path / "test.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 8 + b"PAR1")
    with pytest.raises(DatasetError, match=r"train\.parquet: not a readable Parquet file \(ArrowInvalid"):
        dataset_task(tmp_path, "parquet")


# ----------------------------------------------------------------------------------
# An embedding larger than the tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens)


@pytest.fixture(scope="module")
def padded_vocab_stack(tmp_path_factory):
    """The stack a run builds for the 259-id byte tokenizer with a 512-row embedding, fresh
    weights (nearly uniform logits: without the mask about half the draws are padded ids)."""
    from jaxreplay.train.placement import placement_for
    from jaxreplay.train.stack import build_stack

    directory = tmp_path_factory.mktemp("data")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    for split in ("train", "test"):
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(None, SMALL + [
        "model.vocab_size=512", "model.max_seq_len=24", "task.name=jsonl", f"task.path={directory}/{{split}}.jsonl",
        "task.max_prompt_len=8", "sampling.max_new_tokens=16", "warmstart.steps=0", "train.prompts_per_step=4",
        "train.group_size=8", "train.batch_size=32", "run.progress_bar=false"])
    return build_stack(config, placement_for(config), log=lambda _: None)


def test_padded_embedding_ids_are_never_sampled(padded_vocab_stack):
    stack = padded_vocab_stack
    assert stack.task.tokenizer.vocab_size == ByteTokenizer().vocab_size == 259
    drawn = []
    for step in range(4):
        rows, stats = stack.actor.act(stack.params, 0, step)
        drawn.append(rows["tokens"][rows["completion_mask"].astype(bool)])
        assert stats["reward/errors"] == 0
    drawn = np.concatenate(drawn)
    assert drawn.size > 1000 and drawn.max() < 259, np.sort(drawn)[-5:]


def test_the_learner_scores_padded_vocabularies_as_the_sampler_drew_them(padded_vocab_stack):
    """Per token, the learner's log-prob of a fresh rollout is the one the sampler reported
    (both over the 259 real ids), and the train step's ratio is 1."""
    stack = padded_vocab_stack
    rows, _ = stack.actor.act(stack.params, 0, 0)
    batch = to_device_batch(rows)
    mask = np.asarray(batch["completion_mask"], bool)
    h, unembed = score_hidden(stack.graphdef, stack.params, batch["tokens"], batch["attention_mask"])
    learner, _ = sequence_scores(h, batch["tokens"], unembed, temperature=stack.config.sampling.temperature,
                                 live_vocab=stack.task.tokenizer.vocab_size, with_entropy=False)
    np.testing.assert_allclose(np.asarray(learner)[mask], np.asarray(batch["logprobs"])[mask], atol=1e-5)
    params = jax.tree.map(np.copy, stack.params)  # the step donates its inputs
    _, _, metrics = stack.train_step(params, stack.optimizer.init(params), batch, None)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert float(metrics["approx_kl"]) == pytest.approx(0.0, abs=1e-5)


# ----------------------------------------------------------------------------------
# Resume refusals: a ConfigError, which the CLI reports in one line with exit code 2


@pytest.mark.parametrize("edited", ["banana", -1.0])
def test_a_resume_refuses_an_edited_config_yaml_value_it_would_have_adopted(tmp_path, edited):
    """With replay.calibrate_steps the stored (calibrated) samples_per_insert wins over the
    command line's: an edited, invalid one is refused, not trained on."""
    import yaml

    from jaxreplay.config import ConfigError, to_dict
    from jaxreplay.train.recorder import CONFIG_FILE, resume_config

    given = load_config(None, [f"run.dir={tmp_path}", "replay.calibrate_steps=2", "replay.samples_per_insert=3"])
    stored = to_dict(given)
    stored["replay"]["samples_per_insert"] = edited
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(stored))
    with pytest.raises(ConfigError, match=r"stored config .*config\.yaml, read for replay\.samples_per_insert: "
                                          r"replay\.samples_per_insert"):
        resume_config(tmp_path, given, log=lambda _: None)


# ----------------------------------------------------------------------------------
# What listens where: the coordination service binds the coordinator address's interface


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="reads listening sockets from /proc")
def test_the_coordination_service_listens_only_on_the_coordinator_address(tmp_path):
    """A real 2-process job on 127.0.0.1:P: the kernel shows one listener on P, at 127.0.0.1
    (JAX's default was every interface: [::]:P)."""
    from test_multihost import _assert_all_succeeded, _start_workers

    results = _start_workers(tmp_path, [[], []], worker="listen_worker.py")
    _assert_all_succeeded(results, tmp_path)
    seen = json.loads((tmp_path / "listening.json").read_text())
    assert seen["listening"] == [f"127.0.0.1:{seen['port']}"]


def test_the_bind_address_is_the_coordinators_unless_set_or_left_to_jax(monkeypatch):
    from jaxreplay.train.distributed import bind_address

    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    given = lambda *overrides: load_config(None, list(overrides)).distributed
    assert bind_address(given("distributed.coordinator_address=10.0.0.2:8476")) == "10.0.0.2:8476"
    assert bind_address(given("distributed.coordinator_address=10.0.0.2:8476",
                              "distributed.coordinator_bind_address=[::]:8476")) == "[::]:8476"
    assert bind_address(given()) is None  # cluster detection (a TPU pod): JAX decides
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.3:1234")
    assert bind_address(given()) == "10.0.0.3:1234"
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "0.0.0.0:1234")
    assert bind_address(given()) is None  # JAX reads the user's own variable


def test_mutual_tls_settings_are_checked_naming_the_key(tmp_path):
    from jaxreplay.config import ConfigError
    from jaxreplay.train import distributed

    with pytest.raises(ConfigError, match="distributed.mtls_key_file: mutual TLS needs"):
        load_config(None, [f"distributed.mtls_cert_file={tmp_path}/cert.pem"])
    files = [f"distributed.mtls_{k}_file={tmp_path}/{k}.pem" for k in ("cert", "key", "ca")]
    with pytest.raises(ConfigError, match="distributed.mtls_peer_uri_prefix: .* must end with '/'"):
        load_config(None, [*files, "distributed.mtls_peer_uri_prefix=spiffe://example.org"])
    config = load_config(None, ["distributed.enabled=true", *files])
    with pytest.raises(ConfigError, match=r"distributed.mtls_cert_file: .*cert\.pem is not a readable file"):
        distributed.initialize(config.distributed)  # refused before JAX starts anything


def test_a_jax_without_mutual_tls_refuses_the_mtls_keys_instead_of_ignoring_them(tmp_path):
    """The Reverb tier's jax 0.4.34 has no mTLS: the keys are a config error there, not a silent no-op."""
    import inspect

    from jaxreplay.config import ConfigError
    from jaxreplay.train import distributed

    if "mtls_cert_file" in inspect.signature(jax.distributed.initialize).parameters:
        pytest.skip(f"jax {jax.__version__} takes mutual TLS (the default tier)")
    files = []
    for k in ("cert", "key", "ca"):
        (tmp_path / f"{k}.pem").write_text("")
        files.append(f"distributed.mtls_{k}_file={tmp_path}/{k}.pem")
    config = load_config(None, ["distributed.enabled=true", *files])
    with pytest.raises(ConfigError, match=f"distributed.mtls_cert_file: jax {jax.__version__} cannot take it"):
        distributed.initialize(config.distributed)
