"""The GaLore bench runner on the CPU with small matrices: every variant steps, the table and
JSON are written, and the projected moments take less memory than full-rank AdamW's."""
import json

import pytest

pytest.importorskip("torch")

from mtapply.bench import galore  # noqa: E402


def test_runner_on_small_matrices(tmp_path, monkeypatch):
    monkeypatch.setitem(galore.CASES, "tiny", ([(64, 48), (32, 80)], 8))
    out = tmp_path / "galore.json"
    assert galore.main(["--cases", "tiny", "--steps", "2", "--repeats", "2", "--device", "cpu",
                        "--json", str(out)]) == 0
    all_rows = json.loads(out.read_text())["rows"]
    assert {row["precision"] for row in all_rows} == {"highest", "high"}
    rows = {row["variant"]: row for row in all_rows if row["precision"] == "highest"}
    assert {"mtapply", "torch-fused-full-rank"} <= set(rows)
    assert all(row["ms"] > 0 for row in rows.values())
    # rank-8 moments (and projectors) against two full-size moments per matrix
    assert rows["mtapply"]["state_bytes"] < 0.6 * rows["torch-fused-full-rank"]["state_bytes"]


def test_floor_counts_the_gemm_operands_and_the_rank_r_adam():
    m, n, r = 4096, 4096, 128
    assert galore.floor_bytes([(m, n)], r) == 4 * (3 * m * n + 2 * (m + n) * r + 8 * r * m)
    shapes, rank = galore.shapes_of("gpt2-124M-r128")
    assert rank == 128 and all(len(s) == 2 for s in shapes) and len(shapes) > 40
