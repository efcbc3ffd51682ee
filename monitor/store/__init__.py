"""The store: schema, opening it, migrations, reads, tokens, the audit log and operators."""
