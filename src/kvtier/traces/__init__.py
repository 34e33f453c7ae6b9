"""Workloads and trace readers: request sequences for the demo, the simulator and the analyzer."""
