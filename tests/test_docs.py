"""The README's config reference lists every config key, so the docs cannot drift from the code."""

import dataclasses
import re
from pathlib import Path

from jaxreplay.config import Config

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_covers_every_key():
    text = README.read_text()
    documented = set(re.findall(r"`([a-z_]+\.[a-z0-9_]+)`", text))
    missing = [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(section.default_factory())
        if f"{section.name}.{f.name}" not in documented
    ]
    assert not missing, f"README config reference lacks: {missing}"


def test_readme_quickstart_has_the_two_make_commands_ci_uses():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def test_the_tensorboard_viewer_the_readme_names_has_an_extra():
    """Runs write TensorBoard files without it (tensorboardX), but `tensorboard --logdir`
    needs the viewer, which no default install brings."""
    import tomllib

    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("tensorboard>=") for req in extras.get("tensorboard", []))
    text = README.read_text()
    assert "tensorboard --logdir" in text and "pip install -e '.[tensorboard]'" in text
