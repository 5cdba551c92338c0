"""Engine integrations: the only code of kvoffload's core that imports an inference engine (``kvoffload.tools``,
which drives one, imports it too).

Each sub-package adapts one engine's objects to the connector halves in ``kvoffload.connector``; the core
never imports an engine, so kvoffload installs and tests without one.
"""
