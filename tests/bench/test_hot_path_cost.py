"""The in-process hot-path meter: it runs the real handler and core, and leaves no books."""

from __future__ import annotations

import json

from bench import hot_path_cost


def test_handler_and_core_runs_measure_and_leave_the_books_empty(capsys) -> None:
    # the handler run raises if a request is left in the Conductor's books
    for part in ("handler", "core"):
        assert hot_path_cost.main(["--part", part, "--requests", "30", "--reps", "2"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["part"] == part and result["cpu_us_per_request_median"] > 0


def test_unique_prompts_give_every_request_its_own_user_turn(capsys) -> None:
    assert hot_path_cost.main(["--requests", "20", "--reps", "2", "--unique"]) == 0
    assert json.loads(capsys.readouterr().out)["unique_prompts"] is True
    assert len({hot_path_cost.chat_body(i) for i in range(40)}) == 40


def test_bad_arguments_exit_non_zero(capsys) -> None:
    try:
        hot_path_cost.main(["--requests", "0"])
    except SystemExit as exc:
        assert exc.code == 2
    else:  # pragma: no cover
        raise AssertionError("--requests 0 was accepted")
    assert "--requests" in capsys.readouterr().err
