"""Engine integrations of the kvcellar client; each module imports its engine itself."""
