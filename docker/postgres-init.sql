-- Runs once, when the PostgreSQL data volume is empty: the Prefect database is POSTGRES_DB, this
-- adds MLflow's (owned by the same user).
CREATE DATABASE mlflow;
