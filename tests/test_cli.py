"""The command lines say what they do: help for every flag, defaults from the objects the code uses."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import bank.__main__ as bank_cli
import bank.lab.__main__ as lab_cli
import data.__main__ as data_cli
import parties.__main__ as parties_cli
import partner.__main__ as partner_cli
from bank.config import TrainingConfig
from bank.configurations.split_run import ConfigurationSettings
from parties.cli import run_cli
from parties.transport.pki import write_dev_pki
from parties.learning.model import BottomConfig

PARSERS = {
    "bank": bank_cli.build_parser,
    "bank.lab": lab_cli.build_parser,
    "partner": partner_cli.build_parser,
    "data": data_cli.build_parser,
    "parties": parties_cli.build_parser,
}


def _commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command parser of every CLI, named like ``bank train``."""
    for name, build in PARSERS.items():
        todo = [(name, build())]
        while todo:
            prog, parser = todo.pop()
            yield prog, parser
            for action in parser._actions:  # argparse has no public accessor for subparsers
                if isinstance(action, argparse._SubParsersAction):
                    todo += [(f"{prog} {sub}", p) for sub, p in action.choices.items()]


def _options() -> Iterator[tuple[str, str, argparse.Action]]:
    for prog, parser in _commands():
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield prog, action.option_strings[0], action


def _help(action: argparse.Action) -> str:
    """The help text as ``--help`` prints it (argparse expands ``%(default)s`` the same way)."""
    return (action.help or "") % dict(vars(action), prog="")


def test_every_option_has_help() -> None:
    missing = [f"{prog} {flag}" for prog, flag, action in _options()
               if not action.help or action.help == argparse.SUPPRESS]
    assert not missing, f"options without help text: {missing}"


@pytest.mark.parametrize("prog", [p for p, _ in _commands()])
def test_help_reads_as_plain_text(prog: str) -> None:
    parser = dict(_commands())[prog]
    text = parser.format_help()
    assert "``" not in text, f"{prog} --help shows reST literals"


def _field(model: type, name: str) -> object:
    info = model.model_fields[name]
    return info.default_factory() if info.default_factory is not None else info.default


def _show(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(_show(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


#: Options whose help states a default held by a settings model, not by argparse: the code's default. (The
#: settings' own flags are made from their fields, help and default included: tests/test_flags.py.)
MODEL_DEFAULTS = {
    **{(f"bank {command}", "--fedavg-every"): _field(ConfigurationSettings, "fedavg_every")
       for command in ("walkthrough", "train-branches", "config-bench")},
}


def test_help_defaults_are_the_defaults_the_code_uses() -> None:
    checked = 0
    for prog, flag, action in _options():
        claim = re.search(r"default:? ([^\s;,)]+(?:,[^\s;,)]+)*)", _help(action))
        if (prog, flag) in MODEL_DEFAULTS:
            expected = _show(MODEL_DEFAULTS[prog, flag])
        elif action.default not in (None, False, [], argparse.SUPPRESS):
            expected = _show(action.default)
        else:
            continue  # no default, or one described in words ("every core", "$CUTLAYER_DATA_DIR")
        assert claim is not None, f"{prog} {flag}: help does not state its default {expected}"
        stated = claim.group(1).removesuffix(":")  # "default 0: any free port"
        assert stated == expected, f"{prog} {flag}: help says default {stated}, the code uses {expected}"
        checked += 1
    assert checked >= len(MODEL_DEFAULTS)
    # The two the first user met: the partner's learning rate and the walkthrough's epochs.
    helps = {(prog, flag): _help(action) for prog, flag, action in _options()}
    assert f"default {TrainingConfig().epochs}" in helps["bank walkthrough", "--epochs"]
    assert f"default {BottomConfig().learning_rate:g}" in helps["partner serve", "--lr"]


def _run(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _bank(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: bank_cli.main(argv))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def _lab(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: lab_cli.main(argv))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def test_a_lab_command_given_to_the_product_says_where_it_went(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _bank(["bench", "--rounds", "1"], capsys)
    assert code == 2 and err.strip() == "error: bench is a lab command: python -m bank.lab bench ..."


def test_a_flat_training_setting_is_told_where_it_belongs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "training.json"
    config.write_text(json.dumps({"learning_rate": 0.01, "epochs": 3}))
    code, _, err = _bank(["train", "--url", "https://127.0.0.1:9", "--insecure", "--config", str(config)], capsys)
    assert code == 2 and "Traceback" not in err
    assert str(config) in err and "'learning_rate' is not a top-level setting" in err
    assert '"bank_bottom": {"learning_rate"' in err and "'top'" in err


def test_print_config_shows_every_setting_and_loads_back(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _bank(["train", "--print-config"], capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert TrainingConfig.model_validate(shown) == TrainingConfig()
    assert set(shown) == set(TrainingConfig.model_fields) and "learning_rate" in shown["top"]
    code, out, _ = _bank(["train", "--print-config", "--epochs", "3"], capsys)
    assert json.loads(out)["epochs"] == 3  # the settings this command would use, flags included
    help_text = bank_cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert '"bank_bottom": {"learning_rate"' in help_text and "--print-config" in help_text


def test_a_missing_tls_option_is_one_plain_line(tmp_path: Path) -> None:
    data = tmp_path / "p.csv"
    data.write_text("customer_id,x\n1,2\n")
    run = _run("partner", "serve", "--name", "partner", "--data", str(data))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: TLS is required: give --tls-dir (or --tls-ca/--tls-cert/--tls-key), or --insecure"
    ]


@pytest.mark.parametrize("flags, message", [
    (["--lr", "-1"], "error: --lr: Input should be greater than 0"),
    (["--dp-clip", "0"], "error: --dp-clip: Input should be greater than 0"),
    (["--nopeek", "-1"], "error: --nopeek: Input should be greater than or equal to 0"),
    (["--nopeek", "nan"], "python -m partner serve: error: argument --nopeek: 'nan' is not a finite number"),
    (["--port", "70000"], "error: --port: Input should be less than or equal to 65535"),
], ids=["lr", "dp-clip", "nopeek-negative", "nopeek-nan", "port"])
def test_a_bad_flag_value_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                         message: str) -> None:
    data = tmp_path / "p.csv"
    data.write_text("customer_id,x\n1,2\n")
    argv = ["serve", "--name", "partner", "--data", str(data), "--insecure", *flags]
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: partner_cli.main(argv))
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == message


def test_output_cut_short_by_the_reader_is_no_traceback() -> None:
    run = subprocess.run(f"{shlex.quote(sys.executable)} -m bank train --print-config | head -1", shell=True,
                         capture_output=True, text=True, timeout=120)
    assert run.stdout == "{\n" and "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr


def test_a_walkthrough_without_its_data_is_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    run = _run("bank", "walkthrough", "--no-download", "--cache-dir", str(tmp_path), "--out", str(tmp_path / "run"))
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'bank-full.csv'} does not exist and downloading is off: drop --no-download, or put "
        "bank-full.csv there (or in the folder $CUTLAYER_DATA_DIR names)"
    ]


def test_every_subcommand_help_opens_with_what_it_does() -> None:
    for prog, parser in _commands():
        if " " in prog:
            assert parser.description, f"{prog} --help has no description"


@pytest.mark.parametrize("flags, message", [
    (["--reuse-steps", "3"], "error: invalid training settings: reuse_steps needs local_steps > 1"),
    (["--local-steps", "0"], "error: invalid training settings: --local-steps: Input should be greater than or equal "
                             "to 1"),
    (["--local-steps", "64", "--reuse-steps", "1"], "error: invalid training settings: --local-steps: Input should "
                                                    "be less than or equal to 32"),
], ids=["reuse-without-local-steps", "zero-local-steps", "too-many-local-steps"])
def test_impossible_local_steps_at_the_command_line_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: bank_cli.main(["walkthrough", "--no-download", "--cache-dir", str(tmp_path), *flags]))
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines()[0].startswith(message)


@pytest.mark.parametrize("command", ["train", "walkthrough"])
@pytest.mark.parametrize("flags, message", [
    (["--gradient-defense", "marvell", "--marvell-power", "0"],
     "error: invalid training settings: --marvell-power: Input should be greater than 0"),
    (["--gradient-defense", "marvell", "--marvell-power", "inf"],
     "error: argument --marvell-power: 'inf' is not a finite number"),
    (["--gradient-defense", "isotropic", "--marvell-power", "2"],
     "error: --marvell-power sets the power of --gradient-defense matched or marvell, not of isotropic: give "
     "--gradient-defense matched too, or drop it"),
    (["--gradient-defense", "marvell", "--marvell-persistence", "1.5"],
     "error: invalid training settings: --marvell-persistence: Input should be less than or equal to 1"),
    (["--gradient-defense", "max_norm", "--marvell-persistence", "1"],
     "error: --marvell-persistence sets the persistence of --gradient-defense matched or marvell, not of max_norm: give "
     "--gradient-defense matched too, or drop it"),
    (["--gradient-noise", "2"],
     "error: --gradient-noise sets the noise scale of --gradient-defense isotropic, not of none: give "
     "--gradient-defense isotropic too, or drop it"),
], ids=["zero", "infinite", "other-defense", "persistence-range", "persistence-other-defense", "noise-other-defense"])
def test_an_impossible_marvell_power_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, flags: list[str], message: str,
) -> None:
    where = ["--print-config"] if command == "train" else ["--no-download", "--cache-dir", str(tmp_path)]
    code, _, err = _bank([command, *where, *flags], capsys)
    assert code == 2 and err.strip().splitlines()[-1].endswith(message.removeprefix("error: "))
    assert "Traceback" not in err


def test_train_takes_the_gradient_defense_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bank(["train", "--print-config", "--gradient-defense", "marvell", "--marvell-power", "2"], capsys)
    shown = json.loads(out)
    assert code == 0 and (shown["gradient_defense"], shown["marvell_power"]) == ("marvell", 2.0)


@pytest.mark.parametrize(("study", "flag", "value"), [
    ("privacy-study", "--epochs", "0"), ("privacy-study", "--rows", "0"),
    ("hijack-study", "--runs", "0"), ("hijack-study", "--epochs", "0"), ("hijack-study", "--rows", "-3")])
def test_the_studies_refuse_impossible_counts_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], study: str, flag: str, value: str) -> None:
    code, _, err = _lab([study, "--out", str(tmp_path / "study"), flag, value], capsys)
    assert code == 2 and err.strip().splitlines() == [f"error: {flag} must be at least 1, got {value}"]
    assert not (tmp_path / "study").exists()  # refused before any work


def test_the_walkthrough_refuses_the_rank_test_beside_bank_gradient_noise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Measured: Marvell's noise trips the rank test (an honest bank alarmed at step 215): refused up front."""
    code, _, err = _bank(["walkthrough", "--no-download", "--cache-dir", str(tmp_path), "--hijack-monitor",
                          "--gradient-defense", "marvell", "--marvell-power", "1"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: --hijack-monitor cannot watch a bank that adds gradient noise (--gradient-defense marvell): the rank "
        "test reads that noise as a hijack. Protect labels with --label-dp-epsilon alongside it (see "
        "docs/explanation/privacy.md)"]


@pytest.mark.parametrize("argv", [
    ["partner", "serve", "--name", "p", "--insecure", "--host", "0.0.0.0"],
    ["bank", "serve", "--name", "b", "--label", "y", "--insecure"],
    ["partner", "branch", "--name", "p", "--bank", "b", "--insecure", "--host", "0.0.0.0"],
], ids=["partner-insecure-host", "bank-no-label", "branch-insecure-host"])
def test_a_service_refused_at_start_never_imported_torch(argv: list[str], tmp_path: Path) -> None:
    """Settings and the table are checked first: a refusal takes a second, not the seconds torch takes to load."""
    data = tmp_path / "p.csv"
    data.write_text("customer_id,a\n1,2\n")
    prog, command, *flags = argv
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", prog, command, "--data", str(data), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    refusal = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert refusal and ("loopback" in refusal[0] or "no label column 'y'" in refusal[0])
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "fastapi" not in imported


def test_cutlayer_on_the_path_runs_every_entry_point_under_its_own_name(capsys, pki) -> None:
    from parties.entry import ENTRY_POINTS
    from parties.entry import main as cutlayer

    assert cutlayer([]) == 2
    listed = capsys.readouterr().err
    assert all(f"  {name} " in listed for name in ENTRY_POINTS)
    assert cutlayer(["nope"]) == 2 and "'nope' is not a cutlayer command" in capsys.readouterr().err
    for word in ("bank", "partner", "data", "lab"):
        with pytest.raises(SystemExit):
            cutlayer([word, "--help"])
        assert capsys.readouterr().out.startswith(f"usage: cutlayer {word} ")
    script = Path(sys.executable).parent / "cutlayer"  # pip install puts it beside the interpreter
    run = subprocess.run([str(script), "pki", "show", str(pki / "partner.pem")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "partner 'partner', for 127.0.0.1, localhost, issued by 'Cutlayer development CA'" in run.stdout


@pytest.mark.parametrize("address", ["127.0.0.1", "ray//127.0.0.1:26379", "127.0.0.1:99999", "::1"])
def test_a_malformed_ray_address_is_one_line_naming_the_flag_before_anything_starts(tmp_path, address) -> None:
    files = write_dev_pki(tmp_path / "certs", {"partner": "partner"})
    data = tmp_path / "p.csv"
    data.write_text("customer_id,a\n1,2\n")
    run = subprocess.run([sys.executable, "-m", "partner", "serve", "--name", "partner", "--data", str(data),
                          "--tls-dir", str(files["partner"].cert.parent), "--ray-address", address],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr and f"--ray-address {address!r}: give HOST:PORT" in run.stderr
