"""Libra training application on Megatron-Core (a portion of the `megatron` namespace package).

There is deliberately no `megatron/__init__.py`: this directory joins the installed
`megatron.core` under one namespace, as `megatron.bridge` does.
"""
