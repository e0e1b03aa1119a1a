"""nanoserve control plane: scheduler process, gRPC front end, offline API and CLI. No torch here."""
