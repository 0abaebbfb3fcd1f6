"""Exactly-once steps: lost answers, duplicated and delayed requests still give the bit-identical model."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bank.config import TrainingConfig
from data.prepare import prepare_bank_marketing
from parties.errors import PeerUnavailable
from parties.learning.model import BottomConfig
from parties.transport.client import StepConnection
from tests.training_helpers import federation, saved, state_equal

BOTTOMS = {"bank": BottomConfig(cut_width=8, seed=1), "partner": BottomConfig(hidden=(16,), cut_width=8, seed=2)}


class FaultyConnection(StepConnection):
    """A real step connection to the real partner that loses, repeats and delays messages on cue."""

    def __init__(self, *args: object, faults: dict[int, str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.faults, self.calls, self.injected = faults, 0, []

    def send(self, path: str, body: bytes, content_type: str, limit: int | None = None) -> Callable[[], tuple[int, bytes]]:
        self.calls += 1
        fault = self.faults.get(self.calls)
        if fault == "duplicate":  # the partner gets the request twice; the first answer is thrown away
            super().send(path, body, content_type, limit)()
        if fault == "delay":
            time.sleep(0.3)
        receive = super().send(path, body, content_type, limit)
        if fault == "drop":  # the partner processed it, but the answer never arrives

            def dropped() -> tuple[int, bytes]:
                receive()
                self.connection.close()  # the connection drops; the next step opens a new one
                raise PeerUnavailable("answer lost (injected)")

            return self._note(fault, dropped)
        return self._note(fault, receive) if fault else receive

    def _note(self, fault: str, fn: Callable[[], tuple[int, bytes]]) -> Callable[[], tuple[int, bytes]]:
        self.injected.append(fault)
        return fn


def test_faults_on_the_wire_do_not_change_the_model(pki, bank_full: Path, tmp_path: Path, start_partner) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False)
    config = TrainingConfig(epochs=2, batch_size=64, restore_best=False)
    faults = {3: "drop", 4: "duplicate", 7: "delay", 9: "drop", 10: "drop", 15: "duplicate", 22: "drop"}
    with federation(pki, paths, start_partner, tmp_path, BOTTOMS) as fed:
        clean = fed.coordinator(config, BOTTOMS["bank"]).run()
        connections: list[FaultyConnection] = []

        def faulty(*args: object, **kwargs: object) -> FaultyConnection:
            connections.append(FaultyConnection(*args, faults=faults, **kwargs))
            return connections[-1]

        fed.step_connection = faulty
        coordinator = fed.coordinator(config, BOTTOMS["bank"])
        noisy = coordinator.run()
        partner = coordinator.parties[1]

    assert sorted(connections[0].injected) == sorted(faults.values())
    assert partner.retries == 4  # one per lost answer
    models = fed.partner_core("partner").banks["bank"].folder / "models"
    for folder in (tmp_path / "bank-models", models):
        assert state_equal(saved(folder / clean.session_id / "bottom.safetensors"),
                           saved(folder / noisy.session_id / "bottom.safetensors"))
    assert clean.test_metrics == noisy.test_metrics


def test_both_client_stacks_keep_one_contract(pki, bank_full: Path, tmp_path: Path, start_partner) -> None:
    """Steps on the step connection or over httpx: the same model, the same counts of bytes and round trips."""
    paths = prepare_bank_marketing(tmp_path / "data", rows=800, cache=bank_full.parent, download=False)
    config = TrainingConfig(epochs=1, batch_size=64, restore_best=False)
    with federation(pki, paths, start_partner, tmp_path, BOTTOMS) as fed:
        outcomes, counts = [], []
        for over_httpx in (False, True):
            fed.steps_over_httpx = over_httpx
            coordinator = fed.coordinator(config, BOTTOMS["bank"])
            outcomes.append(coordinator.run())
            partner = coordinator.parties[1]
            assert (partner.steps is None) is over_httpx
            counts.append((partner.round_trips, partner.bytes_sent, partner.bytes_received))
            partner.close()
    models = fed.partner_core("partner").banks["bank"].folder / "models"
    a, b = outcomes
    assert state_equal(saved(models / a.session_id / "bottom.safetensors"),
                       saved(models / b.session_id / "bottom.safetensors"))
    assert a.test_metrics == b.test_metrics
    assert counts[0] == counts[1] and counts[0][0] > a.steps  # every step and control call, counted once
