"""DESIGN.md's package table, the "must not" column, as far as imports can say it: the arrows cannot come back.

A pure AST scan of every ``.py`` under each top-level package (no import is executed, so it takes
well under a second). Each rule names the DESIGN.md row it enforces; a violation is reported as
``file:line: imports X: rule``. What imports cannot express (``ui`` writing through a function it
got from a reader module, a stage holding logic that belongs elsewhere) is left to review.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAGES = ("collector_exporter", "span_to_transition", "trainer", "serving", "rollout", "loop", "judge", "ui")

NETWORK = (
    "aiohttp",
    "httpx",
    "requests",
    "grpc",
    "urllib.request",
    "urllib3",
    "socket",
    "http.client",
    "http.server",
    "websockets",
)

UI_MUST_NOT = (  # the modules whose job is writing the store (or that run a writing stage)
    "store.atomic",
    "store.parquet",
    "store.jsonl",
    "store.lease",
    "collector_exporter.collector",
    "collector_exporter.compactor",
    "collector_exporter.wal",
    "collector_exporter.sdk_exporter",
    "collector_exporter.rewards",
    "span_to_transition.store",
    "span_to_transition.workers",
    "trainer.rounds",
    "trainer.publish_step",
    "trainer.manifest",
    "trainer.checkpoint_store",
    "trainer.publish",
    "trainer.worker",
    "rollout",
    "judge",
    "loop",
)


@dataclass(frozen=True)
class Rule:
    package: str
    forbidden: tuple[str, ...]  # module names; a name forbids itself and everything below it
    why: str


def our_packages(root: Path) -> tuple[str, ...]:
    """Top-level directories of the repo that are Python packages (``tests`` is not one of ours)."""
    return tuple(
        sorted(
            p.name
            for p in root.iterdir()
            if (p / "__init__.py").is_file() and p.name not in ("tests", "bench", "examples")
        )
    )


def rules(ours: tuple[str, ...]) -> list[Rule]:
    """DESIGN.md's "must not" column, one entry per arrow an import can draw."""
    out = [
        Rule(
            "schemas",
            tuple(p for p in ours if p != "schemas"),
            "schemas/ must not import any other package (DESIGN.md: the contracts every stage imports)",
        ),
        Rule(
            "options",
            tuple(p for p in ours if p != "options"),
            "options/ is the ground floor: standard library only, nothing of ours",
        ),
        Rule(
            "store",
            (
                "span_to_transition",
                "collector_exporter",
                "trainer",
                "serving",
                "rollout",
                "ui",
                "loop",
                "judge",
                "httpshell",
                "tracerl",
            ),
            "store/ must not know what a span means: it imports no stage",
        ),
        Rule("httpshell", (*STAGES, "tracerl"), "httpshell/ must not hold endpoints of a stage"),
        Rule(
            "collector_exporter",
            ("span_to_transition",),
            "collector_exporter/ must not parse GenAI semantics (that is span_to_transition/)",
        ),
        Rule("span_to_transition", NETWORK, "span_to_transition/ must not talk to the network"),
        Rule("trainer", ("span_to_transition",), "trainer/ must not parse spans (it reads transitions)"),
        Rule("serving", ("trainer",), "serving/ must not train"),
        Rule("rollout", ("trainer",), "rollout/ must not hold trainer logic"),
        Rule("loop", ("argparse", "tracerl"), "loop/ must not hold CLI parsing"),
        Rule("ui", UI_MUST_NOT, "ui/ must not write to the store (it imports no writer)"),
    ]
    out += [
        Rule(p, ("tracerl",), f"{p}/ must not import tracerl/ (the CLI): no arrow runs back up")
        for p in ours
        if p not in ("tracerl", "options", "schemas", "store", "httpshell")
    ]
    return out


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, wherever it sits (a function body or
    ``if TYPE_CHECKING:`` too). Relative imports stay inside their package and are skipped."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for alias in node.names:  # `from urllib import request` imports urllib.request
                yield node.lineno, f"{node.module}.{alias.name}"


def _matches(module: str, forbidden: str) -> bool:
    return module == forbidden or module.startswith(forbidden + ".")


def violations(root: Path, rule_list: list[Rule]) -> list[str]:
    found = []
    for rule in rule_list:
        pkg = root / rule.package
        if not pkg.is_dir():  # a package DESIGN plans (loop/, judge/) is checked once it exists
            continue
        for path in sorted(pkg.rglob("*.py")):
            seen = set()
            for line, module in imports(path):
                bad = next((f for f in rule.forbidden if _matches(module, f)), None)
                if bad is not None and (line, bad) not in seen:
                    seen.add((line, bad))
                    found.append(f"{path.relative_to(root)}:{line}: imports {module}: {rule.why}")
    return found


def test_no_package_imports_what_design_says_it_must_not():
    found = violations(ROOT, rules(our_packages(ROOT)))
    assert not found, "imports that break DESIGN.md's package table:\n" + "\n".join(found)


def test_the_scan_sees_every_package_design_lists():
    ours = our_packages(ROOT)
    for name in (
        "options",
        "schemas",
        "store",
        "httpshell",
        "collector_exporter",
        "span_to_transition",
        "trainer",
        "serving",
        "rollout",
        "ui",
        "tracerl",
    ):
        assert name in ours
    assert sum(1 for p in ours for _ in (ROOT / p).rglob("*.py")) > 100  # the scan reads the real tree


def test_a_violation_is_reported_with_its_file_line_and_rule(tmp_path):
    """The scanner itself, on a made-up tree: each kind of arrow it must catch, and what it must not flag."""
    files = {
        "schemas/__init__.py": "",
        "schemas/bad.py": "import json\n\nfrom store.location import parse_store\n",
        "store/__init__.py": "",
        "store/x.py": "def f():\n    from span_to_transition.tree import END_MARKER\n",
        "rollout/__init__.py": "",
        "rollout/driver.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tracerl.options\n",
        "span_to_transition/__init__.py": "from . import tree\n",
        "span_to_transition/tree.py": "import json\nfrom urllib import request\nfrom urllib.parse import quote\n",
        "ui/__init__.py": "",
        "ui/ok.py": "from store.views import connect_readonly\nfrom store.location import StoreLocation\n",
        "ui/bad.py": "from store.parquet import write_table_atomic\n",
        "tracerl/__init__.py": "",
        "options/__init__.py": "import argparse\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path, rules(our_packages(tmp_path)))
    assert sorted(f.split(": ", 1)[0] for f in found) == [
        "rollout/driver.py:3",
        "schemas/bad.py:3",
        "span_to_transition/tree.py:2",
        "store/x.py:2",
        "ui/bad.py:1",
    ]
    (schemas,) = [f for f in found if f.startswith("schemas/")]
    assert schemas == (
        "schemas/bad.py:3: imports store.location: schemas/ must not import any other package "
        "(DESIGN.md: the contracts every stage imports)"
    )
    assert any("urllib.request" in f and "network" in f for f in found)
