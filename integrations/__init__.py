"""How the pipeline's stages talk to the systems around them; libraries, not stages:

    mlflow_store.py   where MLflow lives (server or embedded SQLite), runs by identity, dataset inputs, REST reads
    tracking.py       the metric shipper: metrics.jsonl -> MLflow, never blocking training; system metrics
    mlflow_model.py   the registered model's pyfunc (logged as code with each model version)
    mlflow_app.py     the MLflow server app of a stack with users: basic-auth + only admins choose artifact locations
    progress.py       Prefect progress artifacts and artifact keys
    processes.py      process trees from /proc (the train task's torchrun and its ranks)
"""
