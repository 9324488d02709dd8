"""Request and response models of the HTTP API (the job spec itself is ``trainer_core.spec.JobSpec``)."""
