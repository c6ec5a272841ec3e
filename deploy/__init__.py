"""Deployment targets for the MiniBatch server (Ray Serve: ``deploy/ray_serve.py``)."""
