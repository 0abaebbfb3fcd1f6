"""What every party shares: service framework, settings, errors, TLS, protocol messages, data loading."""

from parties.app import create_party_app
from parties.dataset import AlignedRows, FeatureSchema, PartyTable, load_party_table
from parties.errors import CutlayerError
from parties.settings import BankSettings, PartnerSettings, ServiceSettings
from parties.tls import PeerIdentity, TLSFiles, write_dev_pki

__all__ = [
    "AlignedRows",
    "BankSettings",
    "CutlayerError",
    "FeatureSchema",
    "PartnerSettings",
    "PartyTable",
    "PeerIdentity",
    "ServiceSettings",
    "TLSFiles",
    "create_party_app",
    "load_party_table",
    "write_dev_pki",
]
