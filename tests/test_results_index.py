"""benchmarks/results_index.py: docs/benchmarks.md and the README's results table match the result
files, every result file the docs name exists, and a suite the script does not know is listed
from its own ``summary``."""

from __future__ import annotations

import json
from pathlib import Path

import results_index as ri


def test_docs_match_the_results() -> None:
    assert ri.check() == [], "run python benchmarks/results_index.py"


def _repo(tmp_path: Path) -> Path:
    results = tmp_path / "benchmarks" / "results"
    (results / "newsuite").mkdir(parents=True)
    (results / "newsuite" / "avx2_fp32_b1.json").write_text(json.dumps({"date": "2026-12-01", "summary": "it works"}))
    (results / "vllm").mkdir()
    (results / "vllm" / "avx2_fp32.json").write_text(json.dumps(
        {"date": "2026-12-01", "summary": {"plain": 10.0, "ngram": 1.1, "hydra": "0.9x (tau 1.5)"}}))
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# x\n\n{ri.TABLE_BEGIN}\nold\n{ri.TABLE_END}\n")
    return tmp_path


def test_unknown_suites_and_engine_rows_come_from_their_summary(tmp_path: Path) -> None:
    results = _repo(tmp_path) / "benchmarks" / "results"
    index = ri.render_index(results)
    assert "## newsuite" in index and "no description yet" in index and "it works" in index
    assert "| avx2_fp32_b1.json" not in index and "[avx2_fp32_b1.json](../benchmarks/results/newsuite/avx2_fp32_b1.json)" in index
    row = ri.render_table(results).splitlines()[-1]
    link = "(benchmarks/results/vllm/avx2_fp32.json)"
    assert row.startswith("| vLLM (CPU): avx2, fp32 | [avx2_fp32]" + link)
    assert f"[10.0]{link}" in row and f"[1.10x]{link}" in row and f"[0.9x (tau 1.5)]{link}" in row


def test_check_names_what_is_stale_or_missing(tmp_path: Path) -> None:
    root = _repo(tmp_path)
    problems = ri.check(root)
    assert any("docs/benchmarks.md is stale" in p for p in problems)
    assert any("README.md's results table is stale" in p for p in problems)
    (root / "docs" / "benchmarks.md").write_text(ri.render_index(root / "benchmarks" / "results"))
    readme = root / "README.md"
    readme.write_text(ri.with_table(readme.read_text(), ri.render_table(root / "benchmarks" / "results")))
    assert ri.check(root) == []
    (root / "docs" / "history.md").write_text("see `git show 0.1.0:benchmarks/results/old.json` and "
                                              "[a](../benchmarks/results/newsuite/gone.json)")
    (root / "benchmarks" / "results" / "loose.json").write_text("{}")
    problems = ri.check(root)
    assert any(p.endswith("docs/history.md: benchmarks/results/newsuite/gone.json") for p in problems)
    assert not any("old.json" in p for p in problems)  # history in git is not checked
    assert any("outside a suite folder: benchmarks/results/loose.json" in p for p in problems)


def test_result_names() -> None:
    assert ri.parse_name(Path("avx512bf16_bf16_b1_chat.json")) == ("avx512bf16", "bf16", "b1_chat")
    assert ri.parse_name(Path("h100_quick.json")) == ("h100", "", "quick")
    assert ri.result_path("tree_eval", "amx", "fp32", "hydra").relative_to(ri.RESULTS) == Path("tree_eval/amx_fp32_hydra.json")
