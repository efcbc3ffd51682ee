"""The store's Alembic history, shipped inside the package for ``runhealth db upgrade``."""
