"""Reading and writing object stores: S3/MinIO or a local folder (objectstore), and the
model's config.json wherever it lives (model_config).
"""
