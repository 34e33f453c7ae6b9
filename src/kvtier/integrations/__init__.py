"""Engine integrations. Each imports its engine lazily and is the only code that knows the engine's types."""
