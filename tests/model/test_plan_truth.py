"""``plan`` against what runs (issue 43, point 4): the split ``meshnet run``
takes, on machines with room to spare too; what each stage needs as the
node's own check counts it (the KV's least budget, not its most); the
positional argument named and explained. The real model's header only: no
tensor is read, no node started (tests/node/test_memory_truth.py does)."""

from __future__ import annotations

import pytest

from meshnet_cli.run import check_split
from meshnet_model.engines.fit import fit_process
from meshnet_model.plan import main, plan_stages
from support.smollm2 import smollm2_gguf

MiB, GiB = 1 << 20, 1 << 30


def layers(plan: list[dict[str, object]]) -> list[str]:
    return [str(stage["layers"]) for stage in plan]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_plan_splits_as_meshnet_run_does(stages: int) -> None:
    run = [f"{a}:{b}" for a, b in check_split(30, stages, None)]
    assert layers(plan_stages(smollm2_gguf(), stages)) == run
    assert layers(plan_stages(smollm2_gguf(), stages, engine="numpy", dtype="float32")) == run


def test_machines_with_room_get_the_even_split_and_a_tight_one_moves_layers() -> None:
    # Each of 2 GiB and 1 GiB holds half the model with room to spare: the
    # split is meshnet run's (it was 0:29 / 29:30, the first machine's KV 1 GiB).
    roomy = plan_stages(smollm2_gguf(), 2, memories=[2 * GiB, GiB])
    assert layers(roomy) == ["0:15", "15:30"]
    # numpy float32 (513 MiB of weights): 400 MiB cannot hold half, so layers move.
    memories = [700 * MiB, 400 * MiB]
    tight = plan_stages(smollm2_gguf(), 2, engine="numpy", dtype="float32", memories=memories)
    first, second = (range(*map(int, str(s).split(":"))) for s in layers(tight))
    assert len(first) > 15 and second.stop == 30
    for stage in tight:
        assert int(str(stage["need"])) <= int(str(stage["memory"]))


def test_each_stage_needs_what_the_node_check_counts(capsys: pytest.CaptureFixture[str]) -> None:
    for stage in plan_stages(smollm2_gguf(), 2):
        start, stop = map(int, str(stage["layers"]).split(":"))
        (least,) = fit_process(
            smollm2_gguf(),
            [range(start, stop)],
            engine="torch",
            dtype="keep",
            kv_budget_bytes=64 * MiB,
            max_chunk_tokens=2048,
            max_compute_bytes=GiB,
            limit=None,
        )
        assert stage["need"] == least.total < 600 * MiB  # was "resident 1.4 GiB"
    assert main(["plan", str(smollm2_gguf())]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[3] for line in out] == ["0:15", "15:30"]
    assert all(" needs " in line and "KV budget up to" in line for line in out), out


def test_the_positional_argument_is_named_and_explained(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    assert "\n  directory\n" not in text  # the bare name it had, with no help
    assert "\n  MODEL " in text and "a GGUF file or a checkpoint directory" in text
