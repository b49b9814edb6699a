"""Adapters between fsm and the frameworks people already run (issue 30).

Each adapter is a module of its own that imports its framework only when it is used, so
``import fsm.integrations.<name>`` works without the framework and says which extra to install
when a function of it is called without it. Nothing here is imported by ``fsm`` itself.
"""
