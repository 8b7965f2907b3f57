"""`none`: never migrates (the default migration policy)."""

from __future__ import annotations

from policies.views import ClusterView, MigrationOrder


class NoMigration:
    name = "none"

    def plan(self, cluster: ClusterView) -> list[MigrationOrder]:
        return []
