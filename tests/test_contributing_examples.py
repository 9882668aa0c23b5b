"""CONTRIBUTING.md's examples, one per seam: each is written as the one module a user writes, imported by its
documented command (`plugins=[module]`) and trained for one step on the tiny model. The class it registers
must be called, the example must be one file, and the registries are as before once the test ends."""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sparserl.algo.advantages import ADV_ESTIMATORS, ADV_TRANSFORMS
from sparserl.algo.losses import POLICY_LOSSES
from sparserl.config import ConfigError
from sparserl.engine.compression import EVICTION_METHODS
from sparserl.engine.sparse_attention import SELECTORS
from sparserl.errors import UserError
from sparserl.registry import Registry
from sparserl.rollout import BACKENDS, GROUP_SOURCES, WRAPPERS
from sparserl.tasks import TASKS
from sparserl.trainer import Trainer
from sparserl.trainer.addons import ADDONS
from tests.test_trainer import make_trainer, tiny_cfg

CONTRIBUTING = Path(__file__).resolve().parent.parent / "CONTRIBUTING.md"
MARKER = re.compile(r"<!-- example: (\w+) -->")
REGISTRIES: list[Registry] = [
    GROUP_SOURCES, WRAPPERS, BACKENDS, ADV_ESTIMATORS, ADV_TRANSFORMS, POLICY_LOSSES, EVICTION_METHODS,
    SELECTORS, ADDONS, TASKS,
]  # fmt: skip


@dataclass
class Seam:
    """Where an example registers, the method a spy counts (None: the registered function itself), and the
    overrides that fit its documented command to the tiny 2-layer model (a sparse layer, pages small enough
    for a step to choose among them)."""

    registry: Registry
    method: str | None
    tiny: tuple[str, ...] = ()


SEAMS = {
    "group_source": Seam(GROUP_SOURCES, "choose"),
    "backend": Seam(BACKENDS, "run"),
    "advantage": Seam(ADV_ESTIMATORS, None),
    "policy_loss": Seam(POLICY_LOSSES, None),
    "eviction": Seam(EVICTION_METHODS, "score"),
    "page_selector": Seam(SELECTORS, "score", ("kv.page_size=4", "kv.budget=16", "kv.dense_layers=[0]")),
    "addon": Seam(ADDONS, "update"),
    "task": Seam(TASKS, "reward"),
}


@dataclass
class Example:
    """One example of CONTRIBUTING.md: its python blocks by the file each names in its first line ('# f.py'),
    and the key=value overrides of its `sparserl train` command."""

    name: str
    files: dict[str, str]
    command: list[str]


def examples(text: str | None = None) -> list[Example]:
    """Every example: the text from its `<!-- example: NAME -->` marker to the next marker or section heading."""
    parts = MARKER.split(CONTRIBUTING.read_text() if text is None else text)
    out = []
    for name, chunk in zip(parts[1::2], parts[2::2], strict=True):
        chunk = re.split(r"^#{2,6} ", chunk, flags=re.M)[0]  # '# ' starts the blocks' file names
        files: dict[str, str] = {}
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", chunk, flags=re.S)):
            header = re.match(r"# (\S+\.py)\n", block)
            files[header.group(1) if header else f"<block {i} names no file>"] = block
        commands = re.findall(r"^sparserl train (.*)$", chunk, flags=re.M)
        out.append(Example(name, files, commands[0].split() if len(commands) == 1 else []))
    return out


def files_touched(example: Example) -> int:
    """The files a user writes for the example: one per python block (the tests run it with no other edit)."""
    return len(example.files)


@pytest.fixture
def registries(tmp_path: Path):
    """Every registry as before the test: what the example registered is unregistered after it, and its module
    (under tmp_path) forgotten."""
    saved = [dict(r) for r in REGISTRIES]
    modules = set(sys.modules)
    yield
    for registry, before in zip(REGISTRIES, saved, strict=True):
        registry.clear()
        registry.update(before)
    for name in set(sys.modules) - modules:
        if Path(getattr(sys.modules[name], "__file__", None) or "/").is_relative_to(tmp_path):
            del sys.modules[name]


def spy(seam: Seam, name: str) -> list[int]:
    """Count the calls of the registered class's `seam.method` (or of the registered function). Both belong
    to the example's module, and the `registries` fixture puts the registry back."""
    calls: list[int] = []
    entry = seam.registry[name]
    if seam.method is None:

        @functools.wraps(entry)  # keeps the attributes registration set (name, std_normalised, ...)
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return entry(*args, **kwargs)

        seam.registry[name] = counted
        return calls
    original = getattr(entry, seam.method)

    def counted_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    setattr(entry, seam.method, counted_method)
    return calls


def build(example: Example, cfg: Any) -> Trainer:
    """The tiny run's trainer, on the tests' parity task unless the example is a task."""
    return Trainer(cfg) if example.name == "task" else make_trainer(cfg)


def test_there_is_one_example_per_seam():
    assert [e.name for e in examples()] == list(SEAMS)


@pytest.mark.parametrize("example", examples(), ids=lambda e: e.name)
def test_an_example_is_one_file_and_its_class_runs_a_step(example, tmp_path, monkeypatch, registries):
    assert files_touched(example) == 1, f"{example.name}: {list(example.files)}"
    for file, code in example.files.items():
        (tmp_path / file).write_text(code)
    assert len(list(tmp_path.iterdir())) == 1
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = [o for o in example.command if o.startswith("plugins=")]
    assert plugins == [f"plugins=[{Path(next(iter(example.files))).stem}]"], example.command
    selection = [o for o in example.command if not o.startswith("plugins=")]
    if selection:  # without the plugin the name it selects is unknown (to the config, or to the run's setup)
        with pytest.raises(UserError):
            build(example, tiny_cfg(tmp_path, *selection, name="without"))
    seam = SEAMS[example.name]
    before = [set(r) for r in REGISTRIES]
    cfg = tiny_cfg(tmp_path, *example.command, *seam.tiny, "trainer.steps=1")
    added = {r.key: sorted(set(r) - b) for r, b in zip(REGISTRIES, before, strict=True) if set(r) - b}
    assert list(added) == [seam.registry.key] and len(added[seam.registry.key]) == 1, added
    calls = spy(seam, added[seam.registry.key][0])
    build(example, cfg).train()
    assert calls, f"{example.name}: the registered {seam.method or 'function'} was never called"


def test_files_touched_counts_every_block_of_an_example():
    text = "<!-- example: x -->\n```python\n# a.py\npass\n```\n```python\n# b.py\npass\n```\n## Next\n```python\n"
    (two,) = examples(text)
    assert files_touched(two) == 2 and two.command == []


def test_a_plugin_that_cannot_be_imported_is_named(tmp_path):
    with pytest.raises(ConfigError, match="plugins='no_such_plugin': cannot import module 'no_such_plugin'"):
        tiny_cfg(tmp_path, "plugins=[no_such_plugin]")
