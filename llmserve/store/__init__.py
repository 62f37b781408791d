"""Storage: the database engine and sessions (db), the tables (schema) and their Alembic migrations."""
