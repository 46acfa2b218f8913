"""Config: YAML + dotted overrides in, typed and validated Config out, or a one-line error naming the key."""

import dataclasses
import re
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxreplay.config import Config, ConfigError, load_config, to_dict


def test_demo_config_loads_and_overrides_apply():
    c = load_config("configs/demo.yaml", ["replay.samples_per_insert=4", "train.steps=40", "run.dir=runs/x"])
    assert c.replay.samples_per_insert == 4.0 and isinstance(c.replay.samples_per_insert, float)
    assert c.train.steps == 40
    assert c.run.dir == "runs/x"


def test_round_trip_through_yaml(tmp_path):
    import yaml

    c = load_config("configs/demo.yaml", ["task.operations=[+, '-']"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(to_dict(c)))
    assert load_config(path) == c


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.stepz=3", "train.stepz"),
        ("nosuchsection.a=1", "nosuchsection"),
        ("train.steps=abc", "train.steps"),
        ("train.steps=1.5", "train.steps"),
        ("train.steps=true", "train.steps"),
        ("train.steps=0", "train.steps"),
        ("replay.selector=random", "replay.selector"),
        ("replay.mode=offline", "replay.mode"),
        ("sampling.temperature=0", "sampling.temperature"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("model.head_dim=31", "model.head_dim"),
        ("model.max_seq_len=8", "model.max_seq_len"),
        ("train.group_size=1", "train.group_size"),
        ("task.operations=[/]", "task.operations[0]"),
        ("model.param_dtype=float64", "model.param_dtype"),
        ("model.vocab_size=8", "model.vocab_size"),
        ("train=3", "train"),
        ("train.steps", "train.steps"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", [override])
    message = str(err.value)
    assert key in message and "\n" not in message


@pytest.mark.parametrize(
    "overrides, key",
    [
        # The window cannot hold one batch plus one insert: the colocated scheduler would stall.
        (["replay.error_buffer=10", "train.batch_size=64"], "replay.error_buffer"),
        # Reverb's own rule: error_buffer >= max(1, samples_per_insert).
        (["replay.error_buffer=3", "replay.samples_per_insert=4", "train.batch_size=2"], "replay.error_buffer"),
        # A table that can never fill to its sampling threshold.
        (["replay.max_size=64", "replay.min_size_to_sample=128"], "replay.min_size_to_sample"),
        # A batch larger than the table can ever hold.
        (["replay.max_size=64", "replay.min_size_to_sample=32", "train.batch_size=128"], "train.batch_size"),
        (["replay.samples_per_insert=0"], "replay.samples_per_insert"),
        # The positive-bias reader samples whole batches, which deletions mid-batch could stall.
        (["replay.max_times_sampled=2", "replay.positive_fraction=0.2"], "replay.max_times_sampled"),
    ],
)
def test_deadlocking_limiter_settings_are_rejected(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config("configs/demo.yaml", overrides)


def test_on_policy_mode_ignores_ratio_settings():
    c = load_config("configs/demo.yaml", ["replay.mode=on_policy", "replay.error_buffer=1"])
    assert c.replay.mode == "on_policy"


def test_a_mapping_key_takes_dotted_entries_a_flow_mapping_or_a_file_and_reads_back(tmp_path):
    """task.dataset_config is handed on whole; its entries are its owner's to check (local=False: here
    or not, reasoning-gym need not be installed)."""
    import yaml

    gym = ["task.name=reasoning_gym", "task.dataset=products", "warmstart.steps=0", "model.vocab_size=259",
           "model.max_seq_len=300"]
    dotted = load_config(None, [*gym, "task.dataset_config.max_digits=3", "task.dataset_config.min_digits=2"],
                         local=False)
    flow = load_config(None, [*gym, "task.dataset_config={min_digits: 2, max_digits: 3}"], local=False)
    assert dotted == flow and dotted.task.dataset_config == {"max_digits": 3, "min_digits": 2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(to_dict(dotted)))
    assert load_config(tmp_path / "c.yaml", local=False) == dotted
    for value, why in [("[1, 2]", "expected a mapping, got list [1, 2]"), ("{1: 2}", "key 1 is not a name")]:
        with pytest.raises(ConfigError, match=re.escape(f"task.dataset_config: {why}")):
            load_config(None, [*gym, f"task.dataset_config={value}"], local=False)


def test_unknown_key_in_yaml_file_is_rejected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\n  learning_rat: 0.1\n")
    with pytest.raises(ConfigError, match="train.learning_rat"):
        load_config(path)


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match=r"malformed YAML in .*bad\.yaml at line"):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")


def test_a_config_for_other_machines_is_not_checked_against_this_one(tmp_path):
    """`local=False` (the TPU launcher's check for its workers): what this machine lacks is no error,
    every rule of the config itself still is."""
    import importlib.util

    elsewhere = [f"model.hf_path={tmp_path / 'on-the-workers'}", "replay.backend=reverb"]
    with pytest.raises(ConfigError, match="model.hf_path|replay.backend"):
        load_config(None, elsewhere)  # no such directory here (and, on the default tier, no Reverb)
    assert load_config(None, elsewhere, local=False).model.hf_path == str(tmp_path / "on-the-workers")
    with pytest.raises(ConfigError, match="train.batch_size"):
        load_config(None, [*elsewhere, "train.batch_size=0"], local=False)
    if importlib.util.find_spec("reverb") is None:  # nor a Python to run its sidecar (tests/test_sidecar.py)
        with pytest.raises(ConfigError, match="cannot run the Reverb sidecar.*make venv-sidecar"):
            load_config(None, ["replay.backend=reverb", f"replay.reverb_python={sys.executable}"])


_FIELDS = [
    (section.name, f.name)
    for section in dataclasses.fields(Config)
    for f in dataclasses.fields(section.default_factory())
]


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(_FIELDS),
    value=st.one_of(
        st.integers(-10**6, 10**6), st.floats(allow_nan=True), st.booleans(), st.text(max_size=8),
        st.none(), st.lists(st.integers(), max_size=3),
    ),
)
@example(field=("train", "tis_cap"), value="0\x1f")  # str.strip took the control character, float() did not
def test_any_single_override_either_loads_or_raises_config_error(field, value):
    """The parser never crashes with anything but ConfigError, and what it accepts is well typed."""
    import yaml

    section, name = field
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    try:
        c = load_config(None, [f"{section}.{name}={text}"])
    except ConfigError as e:
        assert "\n" not in str(e)
        return
    got = getattr(getattr(c, section), name)
    default = getattr(getattr(Config(), section), name)
    assert type(got) is type(default) or got is None or default is None


def test_scientific_notation_is_a_float_in_overrides_and_files(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 3e-4\n")
    assert load_config(path, ["warmstart.learning_rate=1e-3"]).warmstart.learning_rate == 1e-3
    assert load_config(path).train.learning_rate == 3e-4
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=1e3"])


def test_demo_config_spells_out_the_documented_defaults():
    assert load_config("configs/demo.yaml") == load_config(None)


# --- Numbers: by field type, then by range ------------------------------------------------------
def _fields_of(kind):
    """(section, name) of every field typed `kind` or Optional[`kind`]."""
    import typing

    out = []
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory()):
            tp = hints[f.name]
            if tp is kind or set(typing.get_args(tp)) == {kind, type(None)}:
                out.append(f"{section.name}.{f.name}")
    return out


FLOAT_FIELDS, INT_FIELDS = _fields_of(float), _fields_of(int)


def test_the_field_lists_cover_the_number_fields():
    assert "replay.error_buffer" in FLOAT_FIELDS and "train.adam_b1" in FLOAT_FIELDS and len(FLOAT_FIELDS) >= 25
    assert "replay.max_size" in INT_FIELDS and "run.seed" in INT_FIELDS and len(INT_FIELDS) >= 35


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
@pytest.mark.parametrize("key", FLOAT_FIELDS)
def test_every_float_field_must_be_finite(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number, got -?(inf|nan)$"):
        load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 10**12])
@pytest.mark.parametrize("key", INT_FIELDS)
def test_every_int_field_must_fit_in_32_bits(key, value):
    """Ints reach XLA and Reverb's int32 arguments (replay.max_size=1e12 was a pybind TypeError)."""
    with pytest.raises(ConfigError, match=rf"^{key}: {value} does not fit in 32 bits"):
        load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.adam_b1=1", "train.adam_b1"), ("train.adam_b1=-0.1", "train.adam_b1"),
        ("train.adam_b2=1.5", "train.adam_b2"), ("replay.priority_exponent=-1", "replay.priority_exponent"),
        ("replay.priority_exponent=1000", "replay.priority_exponent"), ("replay.timeout_s=0", "replay.timeout_s"),
        ("replay.timeout_s=1e7", "replay.timeout_s"), ("distributed.timeout_s=-5", "distributed.timeout_s"),
        ("replay.error_buffer=0.5", "replay.error_buffer"),
        ("replay.samples_per_insert=-2", "replay.samples_per_insert"),
        ("run.seed=-1", "run.seed"), ("task.data_seed=-1", "task.data_seed"),
        ("sampling.temperature=1e-40", "sampling.temperature"),
        ("warmstart.teacher_carry_error=1.5", "warmstart.teacher_carry_error"),
        ("replay.port=70000", "replay.port"), ("mesh.actor_devices=-1", "mesh.actor_devices"),
        ("distributed.process_id=-2", "distributed.process_id"), ("train.learning_rate=0", "train.learning_rate"),
    ],
)
def test_numbers_outside_their_range_are_rejected_naming_the_key_and_range(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be (>|>=|in) "):
        load_config(None, [override])


def test_ranges_name_real_number_fields():
    from jaxreplay.config import RANGES

    assert set(RANGES) <= set(FLOAT_FIELDS) | set(INT_FIELDS)


def test_programmatic_configs_get_the_same_checks():
    """validate() runs on configs built in code too (calibration's resolved ratio, tests)."""
    from jaxreplay.config import validate

    c = Config()
    bad = dataclasses.replace(c, replay=dataclasses.replace(c.replay, samples_per_insert=float("inf")))
    with pytest.raises(ConfigError, match="replay.samples_per_insert"):
        validate(bad)


# --- The task owner's checks ------------------------------------------------------------------
def test_a_task_that_can_produce_no_training_problem_is_rejected():
    """One-digit sums are 100 problems: a held-out set of 256 takes them all (train_problems looped forever)."""
    with pytest.raises(ConfigError, match=r"^task.eval_size: .*all 100 problems"):
        load_config(None, ["task.min_digits=1", "task.max_digits=1"])
    with pytest.raises(ConfigError, match="task.eval_size"):
        load_config(None, ["task.min_digits=1", "task.max_digits=1", "task.eval_size=100"])


def test_a_task_with_few_training_problems_still_trains():
    from jaxreplay.tasks.registry import make_task

    c = load_config(None, ["task.min_digits=1", "task.max_digits=1", "task.eval_size=90"])
    task = make_task(c.task)
    problems = task.train_problems(seed=0, index=0, n=16)
    assert len(problems) == 16 and not set(problems) & set(task.eval_problems)


def test_config_module_imports_no_key_owner():
    """Owners (tasks/) import config and register their checks; config imports none of them,
    only the storage layer below it."""
    import ast

    import jaxreplay.config as config_module

    tree = ast.parse(open(config_module.__file__).read())
    imported = {f"{n.module}.{a.name}" if n.module == "jaxreplay" else n.module
                for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("jaxreplay")} == {"jaxreplay.storage"}


# --- YAML: duplicates, expansion, encoding, file kinds -----------------------------------------
@pytest.mark.parametrize("text, key", [
    ("train:\n  steps: 3\ntrain:\n  learning_rate: 0.1\n", "'train'"),
    ("train:\n  steps: 3\n  steps: 4\n", "'steps'"),
])
def test_duplicate_keys_are_refused_naming_the_line(tmp_path, text, key):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"dup\.yaml at line \d+, column \d+: duplicate key {key}"):
        load_config(path)


def test_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("train:\n  <<: {steps: 3, batch_size: 16}\n  steps: 5\n")
    assert load_config(path).train.steps == 5


def test_a_duplicate_key_in_an_override_is_refused():
    with pytest.raises(ConfigError, match="train: duplicate key 'steps'"):
        load_config(None, ["train={steps: 1, steps: 2}"])


def test_an_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    import time

    from test_bad_input import alias_bomb

    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(alias_bomb()) < 500
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="expands to more than") as err:
        load_config(path)
    assert time.perf_counter() - t0 < 5 and len(str(err.value)) < 300


def test_an_alias_bomb_in_an_override_is_refused():
    bomb = "[&a [x,x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], " \
           "[*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]]"
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config(None, [f"task.operations={bomb}"])


def test_error_messages_echo_at_most_a_bounded_part_of_a_value():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=" + "x" * 100_000])
    assert len(str(err.value)) < 200 and str(err.value).endswith("...")
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train." + "k" * 100_000 + "=1"])
    # The echo of the key is bounded; the hint lists the section's keys, which grow with the section.
    assert "k" * 100 not in str(err.value) and len(str(err.value)) < 1000


def test_invalid_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  steps: 3 # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml is not UTF-8 text \(byte 0xe9 at offset 23\)"):
        load_config(path)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os
    import threading

    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    outcome = []

    def load():
        try:
            load_config(fifo)
        except ConfigError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome and "is a FIFO" in outcome[0]


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_text("#" * (2 << 20)), "is larger than"),
    (lambda p: p.write_text("train: " + "[" * 50_000), "nested too deeply"),
    (lambda p: p.write_text("train:\n  steps: " + "9" * 5000 + "\n"), "a number too long"),
])
def test_files_that_are_not_a_small_yaml_document_are_refused(tmp_path, make, message):
    path = tmp_path / "c.yaml"
    make(path)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_floats_from_huge_integers_and_non_string_keys_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="train.learning_rate: .* is too large for a float"):
        load_config(None, ["train.learning_rate=" + "9" * 400])
    path = tmp_path / "c.yaml"
    path.write_text("train: {1: 2, x: 3}\n")
    with pytest.raises(ConfigError, match="unknown key train.1 "):
        load_config(path)
