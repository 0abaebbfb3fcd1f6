"""The passive party: a service that holds features, no labels, and answers the bank."""

from partner.core import PartnerCore
from partner.service import create_app

__all__ = ["PartnerCore", "create_app"]
