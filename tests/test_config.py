"""Config: YAML + dotted overrides in, typed and validated Config out, or a one-line error naming the key."""

import dataclasses

import pytest
from hypothesis import given, settings
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
    if importlib.util.find_spec("reverb") is None:
        with pytest.raises(ConfigError, match="reverb is not installed"):
            load_config(None, ["replay.backend=reverb"])


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
