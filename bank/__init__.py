"""The label holder: alignment and training coordinator, partner proxies, the bank service."""

from bank.alignment import align_with_partners
from bank.operator import BankOperator
from bank.proxy import HttpPartner
from bank.service import create_app

__all__ = ["BankOperator", "HttpPartner", "align_with_partners", "create_app"]
