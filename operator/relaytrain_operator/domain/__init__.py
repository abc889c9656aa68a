"""What the operator knows about jobs, pure: the planner, placement, stage documents, link
certificates, Kueue workloads, recovery and status. No API client, no kopf, no store.
"""
