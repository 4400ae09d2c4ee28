"""Serving a trained run outside this package: its export to CTranslate2."""
