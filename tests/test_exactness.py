"""Split training over the real services is the unsplit model, bit for bit (``torch.equal``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bank.config import TopConfig, TrainingConfig
from bank.vertical.coordinator import epoch_batches
from data.prepare import prepare_bank_marketing
from parties.learning.model import BottomConfig, mlp
from tests.training_helpers import federation, saved, state_equal


def _bottoms(names: list[str]) -> dict[str, BottomConfig]:
    # Every party chooses its own architecture and optimiser; widths agree so "sum" works too.
    own = {
        "bank": BottomConfig(hidden=(16,), cut_width=8, seed=11),
        "partner": BottomConfig(hidden=(12, 10), cut_width=8, seed=22, learning_rate=3e-3),
        "partner2": BottomConfig(hidden=(), cut_width=8, seed=33, optimizer="sgd", learning_rate=0.05),
    }
    return {n: own[n] for n in names}


@pytest.mark.parametrize("n_partners", [1, 2], ids=["1-partner", "2-partners"])
@pytest.mark.parametrize("aggregation", ["concat", "sum"])
def test_split_training_equals_the_unsplit_model(
    pki, bank_full: Path, tmp_path: Path, start_partner, n_partners: int, aggregation: str
) -> None:
    names = ["partner", "partner2"][:n_partners]
    paths = prepare_bank_marketing(
        tmp_path / "data", n_partners=n_partners, partner_names=names, rows=1200,
        cache=bank_full.parent, download=False,
    )
    bottoms = _bottoms(["bank", *names])
    config = TrainingConfig(
        aggregation=aggregation, epochs=2, batch_size=128, patience=10, restore_best=False,
        top=TopConfig(hidden=(8,), seed=5), seed=3,
    )
    with federation(pki, paths, start_partner, tmp_path, bottoms) as fed:
        coordinator = fed.coordinator(config, bottoms["bank"])
        outcome = coordinator.run()
        reference = fed.unsplit(config, coordinator, bottoms)
        for epoch in range(config.epochs):
            reference.train_batches(epoch_batches(coordinator.split.train, config.batch_size, config.seed, epoch), coordinator.targets)

        assert outcome.steps > 10  # several steps, across an epoch boundary and its flush
        session = outcome.session_id
        assert state_equal(saved(tmp_path / "bank-models" / session / "bottom.safetensors"), reference.bottoms["bank"].state_dict())
        for name in names:
            partner_file = fed.partner_core(name).banks["bank"].folder / "models" / session / "bottom.safetensors"
            assert state_equal(saved(partner_file), reference.bottoms[name].state_dict()), name
        assert state_equal(coordinator.top.state_dict(), reference.top.state_dict())
        # And training did move the weights: equality is not two untouched initialisations.
        fresh = fed.unsplit(config, coordinator, bottoms)
        assert not state_equal(fresh.bottoms[names[0]].state_dict(), reference.bottoms[names[0]].state_dict())


def test_the_partner_receives_exactly_the_unsplit_gradient(pki, bank_full: Path, tmp_path: Path, start_partner) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=800, cache=bank_full.parent, download=False)
    bottoms = _bottoms(["bank", "partner"])
    config = TrainingConfig(batch_size=64, top=TopConfig(hidden=(8,), seed=5))
    with federation(pki, paths, start_partner, tmp_path, bottoms) as fed:
        coordinator = fed.coordinator(config, bottoms["bank"])
        own, partner = coordinator.parties
        train = torch.from_numpy(coordinator.split.train)
        for p in (own, partner):
            p.start_training("s1", fed.alignment.alignment_id, train)
        reference = fed.unsplit(config, coordinator, bottoms)
        top = mlp(16, config.top.hidden, 1, activate_output=False, seed=config.top.seed)  # the bank's own top
        rows = epoch_batches(coordinator.split.train, 64, 0, 0)[0]

        # Split: embeddings from each party, the bank's loss, gradients back to the partner.
        zs = [own.step(0, None, rows).requires_grad_(True), partner.step(0, None, rows).requires_grad_(True)]
        loss = coordinator.task.loss(top(torch.cat(zs, dim=1)), coordinator.targets[rows])
        loss.backward()
        partner.step(1, zs[1].grad, None)
        split_grads = {k: v.grad for k, v in fed.partner_core("partner").training("bank", "s1").trainer.model.named_parameters()}

        # Unsplit: one graph, one backward.
        reference.task.loss(reference(rows), coordinator.targets[rows]).backward()
        for name, param in reference.bottoms["partner"].named_parameters():
            assert torch.equal(split_grads[name], param.grad), name
            assert param.grad.abs().sum() > 0


#: The built-in bottom's column embeddings, on either side: each split model must still be its unsplit twin.
EMBEDDED = {
    "ple+categories": {
        "bank": BottomConfig(hidden=(16,), cut_width=8, seed=11, numeric_embedding="ple", bins=8, category_width=3),
        "partner": BottomConfig(hidden=(12,), cut_width=8, seed=22, numeric_embedding="ple", bins=5, numeric_width=3),
    },
    "periodic": {
        "bank": BottomConfig(hidden=(16,), cut_width=8, seed=11, category_width=2),
        "partner": BottomConfig(hidden=(12,), cut_width=8, seed=22, numeric_embedding="periodic", frequencies=4,
                                numeric_width=4, category_width=4, learning_rate=3e-3),
    },
}


@pytest.mark.parametrize("embedded", list(EMBEDDED))
def test_column_embeddings_train_exactly_as_their_unsplit_twin(
    pki, bank_full: Path, tmp_path: Path, start_partner, embedded: str
) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1200, cache=bank_full.parent, download=False)
    bottoms = EMBEDDED[embedded]
    config = TrainingConfig(epochs=2, batch_size=128, patience=10, restore_best=False,
                            top=TopConfig(hidden=(8,), seed=5), seed=3)
    with federation(pki, paths, start_partner, tmp_path, bottoms) as fed:
        coordinator = fed.coordinator(config, bottoms["bank"])
        outcome = coordinator.run()
        reference = fed.unsplit(config, coordinator, bottoms)
        for epoch in range(config.epochs):
            reference.train_batches(epoch_batches(coordinator.split.train, config.batch_size, config.seed, epoch),
                                    coordinator.targets)
        session = outcome.session_id
        assert state_equal(saved(tmp_path / "bank-models" / session / "bottom.safetensors"),
                           reference.bottoms["bank"].state_dict())
        partner_files = fed.partner_core("partner").banks["bank"].folder / "models" / session
        assert state_equal(saved(partner_files / "bottom.safetensors"), reference.bottoms["partner"].state_dict())
        assert state_equal(coordinator.top.state_dict(), reference.top.state_dict())
        # The embeddings are really there and really learned: tables per categorical column, moved by training.
        fresh = fed.unsplit(config, coordinator, bottoms)
        for name in ("bank", "partner"):
            trained = dict(reference.bottoms[name].named_parameters())
            config = bottoms[name]
            assert any(k.startswith("tables.") for k in trained) == bool(config.category_width), name
            assert ("weight" in trained) == (config.numeric_embedding != "none"), name
            assert ("frequencies" in trained) == (config.numeric_embedding == "periodic"), name
            start = dict(fresh.bottoms[name].named_parameters())
            assert all(not torch.equal(trained[k], start[k]) for k in trained if not k.startswith("mlp.")), name
        # A piecewise-linear party saved its quantile edges with its encoder; its scoring encoder rebuilds them.
        encoder = json.loads((partner_files / "encoder.json").read_text())
        assert (encoder.get("bins"), bool(encoder.get("edges"))) == (
            (5, True) if bottoms["partner"].numeric_embedding == "ple" else (None, False))
