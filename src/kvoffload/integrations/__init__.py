"""Engine integrations: the only code in kvoffload that imports an inference engine.

Each sub-package adapts one engine's objects to the connector halves in ``kvoffload.connector``; the core
never imports an engine, so kvoffload installs and tests without one.
"""
