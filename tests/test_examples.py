"""Each example runs end to end with its smoke budget and writes its outputs."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from helpers import start_method

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (the examples are scripts, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_smoke(name: str, out: Path, *extra: str) -> None:
    main: Callable[[list[str]], None] = load(name).main
    # fork: the workers start in milliseconds and inherit the example module as imported here
    with start_method("fork"):
        main(["--smoke", "--out", str(out), *extra])


@pytest.mark.timeout(120)
def test_domain_randomization(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("domain_randomization", tmp_path)
    result = json.loads((tmp_path / "domain_randomization.json").read_text())
    assert result["failures"] == []
    assert any(int(v) > 0 for v in result["measured"])
    assert (tmp_path / "domain_randomization.png").stat().st_size > 0
    assert "verified from the dynamics" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_terrain_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("terrain_table", tmp_path)
    result = json.loads((tmp_path / "terrain_table.json").read_text())
    assert result["failures"] == []
    assert len(result["table_push_ms"]) == 2 and result["frames_checked"] == 6 * 40
    assert result["configs_checked"] >= 2 * 6  # every row push reached every worker's frames
    assert "table[row] of the config its tags name" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_task_bandit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("task_bandit", tmp_path)
    result = json.loads((tmp_path / "task_bandit.json").read_text())
    assert result["failures"] == []
    assert sum(arm["episodes"] for arm in result["arms"]) == result["episodes"] >= 16
    assert all(arm["episodes"] > 0 for arm in result["arms"]), "UCB1 tries every arm"
    assert "mean reward" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_restart_vs_envsync(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("restart_vs_envsync", tmp_path)
    result = json.loads((tmp_path / "restart_vs_envsync.json").read_text())
    assert len(result["restart"]["switches"]) == len(result["envsync"]["switches"]) == 2
    assert result["restart"]["failures"] == result["envsync"]["failures"] == []
    out = capsys.readouterr().out
    assert "restart" in out and "envsync" in out


@pytest.mark.timeout(120)
def test_curriculum_ppo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("curriculum_ppo", tmp_path)
    log = json.loads((tmp_path / "curriculum_ppo.json").read_text())
    assert log["failures"] == []
    first = log["switches"][0]["version"]
    assert log["difficulty_of"][str(first)] > 0 and any(first in versions for versions in log["versions"])
    assert (tmp_path / "curriculum_ppo.png").stat().st_size > 0
    assert "env_versions seen in the data" in capsys.readouterr().out


def test_a_failed_check_exits_non_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from envsync import EnvStateSender
    from envsync.curriculum import Bandit

    bandit = load("task_bandit")

    def forced(args: object) -> object:
        sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty")
        return Bandit(sender, [{"difficulty": 0.0}]), ["forced"]

    monkeypatch.setattr(bandit, "run", forced)
    with pytest.raises(SystemExit) as exit_info:
        bandit.main(["--smoke", "--out", str(tmp_path)])
    assert exit_info.value.code != 0


@pytest.mark.timeout(150)
def test_ray_curriculum(cluster_address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("ray_curriculum", tmp_path, "--address", cluster_address)  # on the test run's cluster
    result = json.loads((tmp_path / "ray_curriculum.json").read_text())
    assert result["stages_reached"] > 1 and result["pushes"] == len(result["push_received_ms"])
    assert result["tags_truthful"] and result["failures"] == []
    assert result["remote_workers"] == 4
    assert "push->received ms" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_adr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("adr", tmp_path)
    result = json.loads((tmp_path / "adr.json").read_text())
    assert result["failures"] == []
    assert result["boundary_results"] > 0
    highs = [record["difficulty.high"] for record in result["history"]]
    assert max(highs) > highs[0], "the range widened where the controller succeeded at its boundary"
    assert (tmp_path / "adr.png").stat().st_size > 0
    assert "every frame showed the config" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_gravity_curriculum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("gravity_curriculum", tmp_path)
    results = json.loads((tmp_path / "gravity_curriculum.json").read_text())
    assert set(results) == {"attributes", "rebuild"}
    for result in results.values():
        assert result["failures"] == [] and len(result["pushed"]) == 3  # the template and two stages
        assert sorted(result["measured"]) == sorted(result["pushed"])  # every version seen in the data
        assert result["pushed"]["0"] == 10.0 and result["pushed"]["2"] == 7.0
    assert (tmp_path / "gravity_curriculum.png").stat().st_size > 0
    assert "every version's frames showed the gravity it pushed" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_plr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_smoke("plr", tmp_path)
    result = json.loads((tmp_path / "plr.json").read_text())
    assert result["failures"] == []
    assert sum(result["seen"]) >= 4 and sum(result["played"].values()) >= sum(result["seen"])
    assert result["draws"]["new"] >= sum(result["seen"])
    assert (tmp_path / "plr.png").stat().st_size > 0
    assert "every frame showed the config" in capsys.readouterr().out


def test_mjlab_adr_without_mjlab_exits_non_zero_saying_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The main venv has no mjlab (it pins mujoco 3.11): the example says where it runs. Its
    smoke run is tests/test_mjlab.py's, in the mjlab venv."""
    monkeypatch.setitem(sys.modules, "mjlab", None)  # `import mjlab` raises ImportError, with or without mjlab
    with pytest.raises(SystemExit) as exit_info:
        load("mjlab_adr").main(["--smoke", "--out", str(tmp_path)])
    message = str(exit_info.value.code)
    assert message.startswith("mjlab is missing") and "make .venv-mjlab/.installed" in message
    assert ".venv-mjlab/bin/python examples/mjlab_adr.py" in message
    assert not (tmp_path / "mjlab_adr.json").exists()


def test_playground_adr_without_playground_exits_non_zero_saying_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The main venv has no MuJoCo Playground (jax, mujoco-mjx): the example says where it runs.
    Its smoke run is tests/test_playground.py's, in the playground venv."""
    monkeypatch.setitem(sys.modules, "mujoco_playground", None)  # `import mujoco_playground` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        load("playground_adr").main(["--smoke", "--out", str(tmp_path)])
    message = str(exit_info.value.code)
    assert message.startswith("MuJoCo Playground is missing") and "make .venv-playground/.installed" in message
    assert ".venv-playground/bin/python examples/playground_adr.py" in message
    assert not (tmp_path / "playground_adr.json").exists()


def test_genesis_adr_without_genesis_exits_non_zero_saying_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The main venv has no Genesis: the example says where it runs. Its smoke run is
    tests/test_genesis.py's, in the genesis venv."""
    monkeypatch.setitem(sys.modules, "genesis", None)  # `import genesis` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        load("genesis_adr").main(["--smoke", "--out", str(tmp_path)])
    message = str(exit_info.value.code)
    assert message.startswith("Genesis is missing") and "make .venv-genesis/.installed" in message
    assert ".venv-genesis/bin/python examples/genesis_adr.py" in message
    assert not (tmp_path / "genesis_adr.json").exists()


@pytest.mark.timeout(180)
def test_physics_dr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mujoco")
    run_smoke("physics_dr", tmp_path)
    log = json.loads((tmp_path / "physics_dr.json").read_text())
    assert log["failures"] == [] and log["episodes_checked"] > 0
    assert log["ranges"][-1]["mass"] != [1.0, 1.0]  # the smoke thresholds widen every boundary
    assert "episodes checked against the simulator's physics" in capsys.readouterr().out
