"""Datasets and their vertical partitioning into per-party files."""

from data.partition import PartitionSpec, PartySpec, bank_marketing_spec, partition, read_source_csv, write_partition
from data.prepare import prepare_bank_marketing
from data.uci import download_bank_marketing, locate_bank_full

__all__ = [
    "PartitionSpec",
    "PartySpec",
    "bank_marketing_spec",
    "download_bank_marketing",
    "locate_bank_full",
    "partition",
    "prepare_bank_marketing",
    "read_source_csv",
    "write_partition",
]
