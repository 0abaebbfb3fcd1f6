"""One settings file per service: ``--print-config`` writes it whole, ``--config`` reads it, flags and the
environment override it, and a mistake in it names the file and the key."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from bank.__main__ import build_parser as bank_parser
from parties.cli import service_settings
from parties.errors import ConfigError
from parties.flags import settings_table
from partner.__main__ import build_parser as partner_parser
from partner.settings import PartnerSettings


def printed(capsys: pytest.CaptureFixture[str], parser, argv: list[str], settings) -> str:
    args = parser().parse_args(argv)
    with pytest.raises(SystemExit) as stop:
        service_settings(args, settings)
    assert stop.value.code == 0
    return capsys.readouterr().out


def settings(argv: list[str]) -> PartnerSettings:
    args = partner_parser().parse_args(["serve", *argv])
    result = service_settings(args, PartnerSettings)
    assert isinstance(result, PartnerSettings)
    return result


def test_print_config_writes_every_setting_and_the_file_starts_the_same_service(
        capsys, tmp_path, pki, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    flags = ["--name", "partner", "--data", "partner.csv", "--tls-dir", str(pki), "--port", "8444",
             "--lr", "0.002", "--peer-max-ids", "bank=42950", "--tls-pin", f"bank={pki / 'ca.pem'}"]
    text = printed(capsys, partner_parser, ["serve", *flags, "--print-config"], PartnerSettings)
    values = tomllib.loads(text)
    # Every setting is in the file, set or commented out, each with the flag that sets it.
    for name, info in PartnerSettings.model_fields.items():
        if name != "insecure":
            assert (f"[{name}]" if settings_table(info) else f"{name} = ") in text, name
    assert "# (--insecure" not in text and "insecure =" not in text
    assert values["port"] == 8444 and values["bottom"]["learning_rate"] == 0.002
    assert "(--lr, CUTLAYER_PARTNER_BOTTOM__LEARNING_RATE)" in text
    # Every flag the file names is one the command takes; a setting without a flag says so.
    serve = partner_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    options = {o for action in serve._actions for o in action.option_strings}
    named = set(re.findall(r"\((--[\w-]+)", text))
    assert len(named) > 30 and named <= options, named - options
    assert "(no flag, CUTLAYER_PARTNER_PRIVACY__SEED)" in text

    config = tmp_path / "partner.toml"
    config.write_text(text)
    from_file = settings(["--config", str(config)])
    from_flags = settings(flags)
    assert from_file == from_flags and from_file.tls_files().pins == ((("bank", pki / "ca.pem"),))


def test_a_flag_overrides_the_environment_which_overrides_the_file(tmp_path, pki, monkeypatch) -> None:
    config = tmp_path / "partner.toml"
    config.write_text(f'name = "partner"\ndata = "p.csv"\ntls_dir = "{pki}"\nport = 1\nworkers = 3\n'
                      f'[bottom]\nlearning_rate = 0.5\n')
    assert settings(["--config", str(config)]).port == 1
    monkeypatch.setenv("CUTLAYER_PARTNER_PORT", "2")
    monkeypatch.setenv("CUTLAYER_PARTNER_BOTTOM__LEARNING_RATE", "0.25")
    both = settings(["--config", str(config)])
    assert (both.port, both.workers, both.bottom.learning_rate) == (2, 3, 0.25)
    flagged = settings(["--config", str(config), "--port", "3", "--lr", "0.125"])
    assert (flagged.port, flagged.workers, flagged.bottom.learning_rate) == (3, 3, 0.125)


@pytest.mark.parametrize("content, message", [
    ('name = "partner"\ndata = "p.csv"\ntls_dir = "t"\nprot = 8444\n', "partner.toml: prot: not a known setting"),
    ('name = "partner"\ndata = "p.csv"\ntls_dir = "t"\nport = "many"\n', "partner.toml: port: Input should be"),
    ('name = "partner"\ndata = "p.csv"\ninsecure = true\n', "partner.toml: insecure: a file cannot turn TLS off"),
    ('name = "partner\n', "partner.toml: not valid TOML"),
], ids=["unknown-key", "wrong-type", "insecure", "not-toml"])
def test_a_mistake_in_the_file_names_the_file_and_the_key(tmp_path, content, message) -> None:
    config = tmp_path / "partner.toml"
    config.write_text(content)
    with pytest.raises(ConfigError, match=message):
        settings(["--config", str(config)])


def test_the_bank_prints_its_own_file(capsys, pki) -> None:
    from bank.settings import BankSettings

    text = printed(capsys, bank_parser, ["serve", "--print-config", "--partner", "telco=https://127.0.0.1:8444"],
                   BankSettings)
    values = tomllib.loads(text)
    assert values["partners"] == {"telco": "https://127.0.0.1:8444"}
    assert "# name = (required)" in text and text.startswith("# bank serve:")


def test_a_service_starts_from_its_file_alone(tmp_path, pki, write_csv) -> None:
    """The one subprocess: ``python -m partner serve --config FILE`` listens, as the file says."""
    data = write_csv("p.csv", customer_id=["1", "2", "3"], x=["1", "2", "3"])
    ready = tmp_path / "ready.json"
    config = tmp_path / "partner.toml"
    config.write_text(f'name = "partner"\ndata = "{data}"\ntls_dir = "{pki}"\nworkers = 1\nready_file = "{ready}"\n'
                      f'state_dir = "{tmp_path / "state"}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "partner", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:

        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:] if proc.stdout else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ready.read_text().startswith('{"url": "https://127.0.0.1:')
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_deployment_guides_example_files_are_settings_each_service_takes(tmp_path) -> None:
    from bank.settings import BankSettings
    from parties.settings import load_settings

    page = (Path(__file__).resolve().parents[1] / "docs" / "how-to" / "deployment.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 2
    for block, model, name in ((blocks[0], PartnerSettings, "telco"), (blocks[1], BankSettings, "bank")):
        config = tmp_path / f"{name}.toml"
        config.write_text(block)
        loaded = load_settings(model, config)
        assert loaded.name == name and loaded.tls_pin and loaded.port in (8443, 8444)


def test_a_mapping_given_as_flags_replaces_the_files(tmp_path, pki) -> None:
    """A pin in the file and another on the command line: the command line's alone, as for any setting (a
    file's pin left beside it would widen which CA may speak for a peer)."""
    config = tmp_path / "partner.toml"
    config.write_text(f'name = "partner"\ndata = "p.csv"\ntls_dir = "{pki}"\n'
                      f'tls_pin = {{"bank" = "{pki / "ca.pem"}", "bank2" = "{pki / "ca.pem"}"}}\n'
                      f'[bottom]\nlearning_rate = 0.5\nhidden = [8]\n')
    assert set(settings(["--config", str(config)]).tls_pin) == {"bank", "bank2"}
    flagged = settings(["--config", str(config), "--tls-pin", f"bank={pki / 'ca.pem'}", "--lr", "0.25"])
    assert flagged.tls_pin == {"bank": pki / "ca.pem"}
    assert (flagged.bottom.learning_rate, flagged.bottom.hidden) == (0.25, (8,))  # a table takes from both


def test_a_mapping_comes_whole_from_the_highest_source_that_sets_it(tmp_path, pki, monkeypatch) -> None:
    """The environment's partners do not merge with the file's, nor the flags' with the environment's."""
    from bank.settings import BankSettings
    from parties.settings import load_settings

    config = tmp_path / "bank.toml"
    config.write_text(f'name = "bank"\ndata = "b.csv"\ntls_dir = "{pki}"\n'
                      f'partners = {{"stale" = "https://127.0.0.1:1"}}\n')
    monkeypatch.setenv("CUTLAYER_BANK_PARTNERS", '{"p1": "https://127.0.0.1:2"}')
    assert load_settings(BankSettings, config).partners == {"p1": "https://127.0.0.1:2"}
    flagged = load_settings(BankSettings, config, partners={"p2": "https://127.0.0.1:3"})
    assert flagged.partners == {"p2": "https://127.0.0.1:3"}
