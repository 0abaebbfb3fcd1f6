"""Why the bank-only model is what it is, measured on a run. SIMULATION ONLY: it reads every party's file.

Two questions about the bank's customers no partner holds (``python -m bank.lab subset-study [RUN]``):

1. **Which model for the bank alone?** The run's bank-only model (HistGradientBoosting) against an MLP of
   the bank bottom's shape with a head of the top's shape, trained on the same rows (the aligned and
   unaligned training shares) with the joint schedule, on the same held-out customers.
2. **Do the unaligned customers help the joint model?** The run's joint model trained unsplit (which is
   the split model, bit for bit), from its own initial weights and with the bank's bottom first trained
   on every bank training customer, aligned or not (through a bank-only head), over several batch seeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn import metrics as skm

from bank.scoring.bank_only import BankOnlyModel
from bank.config import TopConfig
from bank.epochs import EpochBook
from bank.vertical.results import Run
from bank.lab.references.models import _partner_bottom, _party_files, fit_unsplit, joined_features
from bank.lab.references.unsplit import UnsplitModel
from bank.scoring.manifest import read_manifest
from bank.task import Task
from bank.vertical.coordinator import epoch_batches
from parties.learning.model import BottomConfig, build_bottom, mlp
from parties.tables.encoding import TabularEncoder
from parties.tables.table import load_party_table

__all__ = ["run_subset_study"]


def _auc(y: np.ndarray, s: np.ndarray) -> float:
    return float(skm.roc_auc_score(y, s))


def _fit_mlp(x: torch.Tensor, y: torch.Tensor, train: np.ndarray, val: np.ndarray, bottom: BottomConfig,
             top: TopConfig, epochs: int, patience: int, seed: int) -> torch.nn.Module:
    """Bank bottom + head on the bank's columns, the joint schedule, early stopping on validation ROC-AUC."""
    model = torch.nn.Sequential(build_bottom(x.shape[1], bottom),
                                mlp(bottom.cut_width, top.hidden, 1, activate_output=False, seed=top.seed))
    optimizer = torch.optim.Adam(model.parameters(), lr=bottom.learning_rate)
    book = EpochBook(patience)
    for epoch in range(epochs):
        for rows in epoch_batches(train, 1024, seed, epoch):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[rows]).squeeze(1), y[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            auc = _auc(y[val].numpy(), model(x[val]).squeeze(1).numpy())
        book.record(auc, state=model.state_dict)
        if book.stop:
            break
    model.load_state_dict(book.best_state)
    return model.eval()


def run_subset_study(run: Run, seeds: int = 3, partition: Path | None = None) -> dict[str, pd.DataFrame]:
    """The two tables: ``bank_only`` (model choice) and ``warm_start`` (joint test ROC-AUC per batch seed)."""
    torch.set_num_threads(1)  # as the parties compute: the unsplit model is then the split model bit for bit
    label_party, files = _party_files(run, partition)
    bank = load_party_table(files[label_party], labelled=True)
    y_all = (bank.labels.astype(str).str.strip() == "yes").to_numpy().astype(np.float32)
    split = run.split
    unaligned = pd.read_csv(run.path / "unaligned_split.csv")
    rows = {f"aligned {k}": split.loc[split["split"] == k, "bank_row"].to_numpy() for k in ("train", "val", "test")}
    rows |= {f"unaligned {k}": unaligned.loc[unaligned["split"] == k, "bank_row"].to_numpy()
             for k in ("train", "val", "test")}
    train = np.concatenate([rows["aligned train"], rows["unaligned train"]])
    val = np.concatenate([rows["aligned val"], rows["unaligned val"]])
    config = run.config
    bottom, top = BottomConfig.model_validate(config["bank_bottom"]), TopConfig.model_validate(config["top"])

    manifest = read_manifest(run.model_dir("bank"))
    hgb = BankOnlyModel.load(run.model_dir("bank") / "subsets" / "bank", manifest.subsets["bank"].files,
                             Task.from_dict(manifest.task))
    encoder = TabularEncoder(bank.schema).fit(bank.features.iloc[train])
    x, y = torch.from_numpy(encoder.transform(bank.features)), torch.from_numpy(y_all)
    bank_mlp = _fit_mlp(x, y, train, val, bottom, top, config["epochs"], config["patience"], config["seed"])
    with torch.no_grad():
        mlp_scores = torch.sigmoid(bank_mlp(x).squeeze(1)).numpy()
    hgb_scores = hgb.predict(bank.features[list(hgb.encoder_.schema.columns)])[0]
    bank_only = pd.DataFrame([
        {"model": name, **{f"roc_auc {group}": _auc(y_all[rows[group]], scores[rows[group]])
                           for group in ("unaligned test", "aligned test")}}
        for name, scores in (("HistGradientBoosting (the run's bank-only model)", hgb_scores),
                             ("MLP: bank bottom + head, same rows", mlp_scores))
    ])

    # The joint model with the bank's bottom pretrained on every bank training customer (the MLP above was
    # trained on the bank's own encoder; the joint bottom's encoder is fitted on the aligned training rows).
    features, targets, splits = joined_features(run, partition)
    joint_encoder = TabularEncoder(bank.schema).fit(bank.features.iloc[rows["aligned train"]])
    x_joint = torch.from_numpy(joint_encoder.transform(bank.features))
    pretrained = _fit_mlp(x_joint, y, train, val, bottom, top, config["epochs"], config["patience"], config["seed"])
    bottoms = {"bank": bottom} | {n: _partner_bottom(run, n) for n in features if n != "bank"}
    warm = []
    for seed in range(seeds):
        row: dict[str, float] = {"batch_seed": seed}
        for start, initial in (("from its own initial weights", None), ("bank bottom pretrained", pretrained[0])):
            model = UnsplitModel(features, bottoms, top, config["aggregation"], Task("binary"))
            if initial is not None:
                model.bottoms["bank"].load_state_dict(initial.state_dict())
            row[start] = _auc(targets[splits["test"]], fit_unsplit(model, targets, splits, config, seed))
        warm.append(row)
    return {"bank_only": bank_only, "warm_start": pd.DataFrame(warm)}

