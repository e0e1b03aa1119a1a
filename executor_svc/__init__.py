"""The data plane: executor process, model runner, models, layers, sampler and weight loader.

Everything here uses torch; the control plane (scheduler_svc) never imports it.
"""
