"""A service's flags are its settings: every setting has one, its help states the model's default, and what a
flag gives reaches the setting (or a problem names the flag), beside the environment and the defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import BaseModel

import bank.__main__ as bank_cli
import partner.__main__ as partner_cli
from bank.settings import BankSettings
from parties.cli import service_settings
from parties.errors import ConfigError
from parties.flags import Flag, flag_for, show
from partner.settings import BranchSettings, ComputeSettings, PartnerSettings

SERVE = {
    ("bank", "serve"): (bank_cli.build_parser, BankSettings),
    ("partner", "serve"): (partner_cli.build_parser, PartnerSettings),
    ("partner", "compute"): (partner_cli.build_parser, ComputeSettings),
    ("partner", "branch"): (partner_cli.build_parser, BranchSettings),
}


def _subparser(build, command: str) -> argparse.ArgumentParser:
    parser = build()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _settings(model: type[BaseModel], path: tuple[str, ...] = ()):
    """Every setting of ``model``, nested ones too: (path, field info)."""
    for name, info in model.model_fields.items():
        nested = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) else None
        if nested is not None:
            yield from _settings(nested, (*path, name))
        else:
            yield (*path, name), info


@pytest.mark.parametrize("role, command", list(SERVE))
def test_every_setting_is_a_flag_whose_help_states_the_models_default(role: str, command: str) -> None:
    build, model = SERVE[role, command]
    actions = {a.option_strings[0]: a for a in _subparser(build, command)._actions if a.option_strings}
    checked = 0
    for path, info in _settings(model):
        meta = next((m for m in info.metadata if isinstance(m, Flag)), Flag())
        if not meta.cli or (command == "compute" and path[0] in ("data", "id_column", "id_type", "schema_file",
                                                                   "categorical", "numeric")):
            continue
        flag = flag_for(model, path)
        assert flag in actions, f"{role} {command}: {'.'.join(path)} has no flag {flag}"
        text = actions[flag].help or ""
        assert info.description and info.description.rstrip(".").replace("%", "%%") in text, flag
        default = info.default_factory() if info.default_factory is not None else info.default
        if meta.default is not None:
            assert text.endswith(f"(default {meta.default})")
        elif default not in (None, (), {}) and not isinstance(default, bool) and not info.is_required():
            assert text.endswith(f"(default {show(default)})"), f"{flag}: {text!r}"
        checked += 1
    assert checked >= 20


def _partner(argv: list[str], tmp_path: Path) -> PartnerSettings:
    args = _subparser(partner_cli.build_parser, "serve").parse_args(
        ["--name", "p", "--data", str(tmp_path / "p.csv"), "--insecure", *argv])
    settings = service_settings(args, PartnerSettings)
    assert isinstance(settings, PartnerSettings)
    return settings


def test_what_a_flag_gives_reaches_its_setting(tmp_path: Path) -> None:
    s = _partner(["--lr", "0.01", "--hidden", "32,16", "--cut-width", "8", "--seed", "secret",
                  "--dp-clip", "1.5", "--nopeek", "0.2", "--hijack-monitor", "--hijack-task-rank", "2",
                  "--hijack-window", "40", "--peer-max-ids", "bank=500", "--peer-max-ids", "300",
                  "--disk-quota-per-bank", "500M", "--checkpoint-ttl", "60", "--cpus", "0",
                  "--categorical", "a,b", "--max-psi-sessions", "3"], tmp_path)
    assert (s.bottom.learning_rate, s.bottom.hidden, s.bottom.cut_width, s.bottom.seed) == (0.01, (32, 16), 8, None)
    assert (s.privacy.clip, s.privacy.nopeek) == (1.5, 0.2)
    assert (s.monitor.watch, s.monitor.task_rank, s.monitor.window) == (True, 2, 40)
    assert s.psi_limits.peer_max_ids == {"bank": 500, "*": 300}
    assert (s.quotas.disk_per_bank, s.quotas.checkpoint_ttl) == (500 << 20, 60.0)
    assert (s.cpus, s.categorical, s.max_psi_sessions) == ((0,), ("a", "b"), 3)
    # "none" is a value, not "not given": no quota.
    assert _partner(["--disk-quota-per-bank", "none"], tmp_path).quotas.disk_per_bank is None


def test_a_flag_not_given_leaves_the_environment_then_the_default(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert _partner([], tmp_path).bottom.learning_rate == 5e-3
    monkeypatch.setenv("CUTLAYER_PARTNER_BOTTOM__LEARNING_RATE", "0.02")
    monkeypatch.setenv("CUTLAYER_PARTNER_MAX_PSI_SESSIONS", "7")
    s = _partner(["--max-psi-sessions", "2"], tmp_path)
    assert (s.bottom.learning_rate, s.max_psi_sessions) == (0.02, 2)


@pytest.mark.parametrize("argv, flag", [
    (["--cut-width", "0"], "--cut-width"),
    (["--lr", "-1"], "--lr"),
    (["--peer-max-ids", "bank=0"], "--peer-max-ids"),
    (["--hijack-window", "0"], "--hijack-window"),
    (["--hijack-project"], "--hijack-monitor"),
    (["--dp-noise", "-0.5"], "--dp-noise"),
    (["--psi-sessions-per-hour", "0"], "--psi-sessions-per-hour"),
    (["--checkpoint-ttl", "0"], "--checkpoint-ttl"),
])
def test_a_bad_setting_names_its_flag(argv: list[str], flag: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=flag):
        _partner(argv, tmp_path)


def test_bank_flags_reach_the_bank_settings(tmp_path: Path) -> None:
    args = _subparser(bank_cli.build_parser, "serve").parse_args(
        ["--name", "bank", "--data", str(tmp_path / "b.csv"), "--insecure", "--partner", "p1=http://127.0.0.1:1",
         "--partner", "p2=http://127.0.0.1:2/", "--max-overlap", "0.5", "--task", "regression",
         "--psi-sessions-per-hour", "5"])
    s = service_settings(args, BankSettings)
    assert isinstance(s, BankSettings)
    assert s.partners == {"p1": "http://127.0.0.1:1", "p2": "http://127.0.0.1:2"}
    assert (s.max_overlap, s.task, s.psi_limits.sessions_per_hour) == (0.5, "regression", 5)


def test_a_malformed_flag_is_named_by_argparse(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    parser = _subparser(bank_cli.build_parser, "serve")
    for argv, said in ((["--partner", "p1"], "--partner"), (["--max-overlap", "2"], "--max-overlap"),
                       (["--cpus", "x"], "--cpus")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["--name", "bank", "--data", str(tmp_path / "b.csv"), *argv])
        assert exit_.value.code == 2
        assert said in capsys.readouterr().err


def test_train_takes_every_training_setting_as_a_flag_and_the_walkthrough_hands_partner_ones_on(
        tmp_path: Path) -> None:
    from bank.commands import _partner_defenses
    from bank.config import TrainingConfig
    from parties.learning.config import PartnerDefenses
    from parties.flags import flag_values

    actions = {a.option_strings[0]: a for a in _subparser(bank_cli.build_parser, "train")._actions if a.option_strings}
    for name, info in TrainingConfig.model_fields.items():
        if name in ("bank_bottom", "top"):  # nested: --config's file
            continue
        flag = flag_for(TrainingConfig, (name,))
        assert flag in actions and info.description and info.description.rstrip(".") in (actions[flag].help or "")
    args = _subparser(bank_cli.build_parser, "walkthrough").parse_args(
        ["--epochs", "3", "--dp-clip", "1", "--dp-noise", "0.5", "--hijack-monitor", "--hijack-probe-every", "7",
         "--nopeek", "0.1"])
    assert flag_values(args, TrainingConfig) == {"epochs": 3}
    handed = _partner_defenses(flag_values(args, PartnerDefenses))
    assert sorted(handed) == sorted(["--dp-clip=1.0", "--dp-noise=0.5", "--nopeek=0.1", "--hijack-monitor",
                                     "--hijack-probe-every=7"])
    # What the walkthrough hands on, a partner's own command line reads back to the same settings.
    assert _partner(handed, tmp_path).monitor.probe_every == 7
    with pytest.raises(ConfigError, match="--dp-noise"):
        _partner_defenses({"privacy": {"noise": -1.0}})


def test_a_repeated_flag_gives_every_occurrence(tmp_path: Path) -> None:
    args = _subparser(partner_cli.build_parser, "compute").parse_args(
        ["--name", "trunk", "--insecure", "--bank", "north", "--bank", "south"])
    settings = service_settings(args, ComputeSettings)
    assert isinstance(settings, ComputeSettings) and settings.banks == ("north", "south")


def test_the_partner_defenses_the_walkthrough_takes_are_named_as_the_partners_own_flags() -> None:
    from parties.learning.config import PartnerDefenses

    paths = [path for path, info in _settings(PartnerDefenses)
             if next((m for m in info.metadata if isinstance(m, Flag)), Flag()).cli]
    assert len(paths) >= 15
    for path in paths:
        assert flag_for(PartnerDefenses, path) == flag_for(PartnerSettings, path)
