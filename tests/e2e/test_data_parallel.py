"""`--data-parallel-size 2`: the admin API sees and steers every engine core, not only the first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_support import ADMIN_TOKEN, auth, client

pytestmark = pytest.mark.e2e

FLASHHEAD = "/plugins/my_pkg/flashhead"


def test_every_engine_is_listed_and_updated(dp2_server):
    admin = auth(ADMIN_TOKEN)
    with client(dp2_server) as http:
        workers = http.get("/plugins/my_pkg/workers", headers=admin).json()["workers"]
        assert [(w["dp_rank"], w["rank"]) for w in workers] == [(0, 0), (1, 0)]
        assert workers[0]["pid"] != workers[1]["pid"]
        before = http.get(FLASHHEAD, headers=admin).json()["workers"]
        target = before[0]["n_probes"] + 5
        response = http.put(FLASHHEAD, json={"n_probes": target}, headers=admin)
        assert response.status_code == 200, response.text
        assert response.json()["num_workers"] == 2
        assert response.json()["engines"] == [0, 1] and response.json()["other_nodes_untouched"] is False
        assert {w["settings_version"] for w in response.json()["workers"]} == {response.json()["settings_version"]}
        after = http.get(FLASHHEAD, headers=admin).json()["workers"]
        assert [(s["dp_rank"], s["n_probes"]) for s in after] == [(0, target), (1, target)]

        def complete(i: int) -> dict:
            body = {"model": dp2_server.model, "prompt": f"water food and fire {i}", "max_tokens": 8, "temperature": 0}
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            return reply.json()

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(complete, range(8)))
        served = http.get(FLASHHEAD, headers=admin).json()["workers"]
        assert all(s["active"] for s in served), served
        assert sum(s["counters"]["rows_flashhead"] for s in served) >= 8 * 7
        metrics = http.get("/plugins/my_pkg/metrics", headers=admin).text
        assert 'my_pkg_flashhead_n_probes{dp_rank="1",rank="0"}' in metrics
