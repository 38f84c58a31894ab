"""bench.chat_render: runs on a template, checks every skeleton render, refuses bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import chat_render
from tests.tiny_model import CHATML


def test_measures_both_workloads_and_writes_json(tmp_path: Path) -> None:
    template = tmp_path / "chat_template.jinja"
    template.write_text(CHATML)
    out = tmp_path / "out.json"
    args = ["--template", str(template), "--requests", "50", "--reps", "1", "--json", str(out)]
    assert chat_render.main(args) == 0
    result = json.loads(out.read_text())
    for workload in ("plain", "agent"):
        got = result["workloads"][workload]
        assert got["template_us"] > 0 and got["skeleton_us"] > 0
        assert got["skeletons"]["shapes_learned"] == 1  # one shape per workload
        assert got["skeletons"]["skeleton_renders"] >= 49 and not got["skeletons"]["off"]


@pytest.mark.parametrize("source", [None, "{% for %}"])
def test_a_missing_or_broken_template_is_named(
    tmp_path: Path, source: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    template = tmp_path / "t.jinja"
    if source is not None:
        template.write_text(source)
    assert chat_render.main(["--template", str(template)]) == 2
    assert str(template) in capsys.readouterr().err
