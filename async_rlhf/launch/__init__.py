"""The wiring: what puts the parts together into a job. The CLI, the launcher and its Ray roles,
the job's local Ray cluster, job control, placement and the bench. The one layer that imports
actors/, learners/ and buffer/ (tests/test_layout.py holds every layer to its imports)."""
