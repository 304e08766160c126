-- Runs once, when the PostgreSQL data volume is empty (the image's docker-entrypoint-initdb.d runs it with
-- `psql -v ON_ERROR_STOP=1 -f`, connected to POSTGRES_DB as the superuser POSTGRES_USER; tests/postgres.py
-- runs it the same way). Each server gets its own role, neither a superuser, owning its own database:
-- a leaked MLflow password then opens MLflow's tables only, not Prefect's (its Secret blocks) and not the
-- server (a superuser may `COPY ... TO PROGRAM`, i.e. run commands as the postgres OS user).
-- The passwords come from the container's environment (docker/.env: PREFECT_DB_PASSWORD,
-- MLFLOW_DB_PASSWORD) through psql's \getenv, so they never appear in a command line.
\set ON_ERROR_STOP on
\getenv prefect_password PREFECT_DB_PASSWORD
\getenv mlflow_password MLFLOW_DB_PASSWORD
\if :{?prefect_password}
\else
    \set prefect_password ''
\endif
\if :{?mlflow_password}
\else
    \set mlflow_password ''
\endif
SELECT length(:'prefect_password') > 0 AND length(:'mlflow_password') > 0 AS passwords_set \gset
\if :passwords_set
\else
    DO $$ BEGIN RAISE EXCEPTION 'PREFECT_DB_PASSWORD and MLFLOW_DB_PASSWORD must be set: set both in docker/.env (openssl rand -hex 24)'; END $$;
\endif

CREATE ROLE prefect LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'prefect_password';
CREATE ROLE mlflow LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'mlflow_password';
-- POSTGRES_DB (prefect) was made by the image for the superuser: hand it over, and add MLflow's
ALTER DATABASE prefect OWNER TO prefect;
CREATE DATABASE mlflow OWNER mlflow;
-- PUBLIC may connect to every database by default: only each owner (and the superuser) may now
REVOKE ALL ON DATABASE prefect FROM PUBLIC;
REVOKE ALL ON DATABASE mlflow FROM PUBLIC;
