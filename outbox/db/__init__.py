"""Database plumbing: Core tables, named queries, migrations, DSNs, running plans."""
