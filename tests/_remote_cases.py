"""Which servers a test of the ``remote`` fixture (remote_fixtures.py) runs against.

A helper module, not the plugin: a test module importing ``remote_fixtures`` itself would
import it before pytest can rewrite its asserts.
"""

from __future__ import annotations

import pytest

#: For a test of ``remote`` that does not apply to GCS: gcsfs retries each request six times
#: over ~35 s itself (no option turns it off), and asks sizes with GETs of object metadata
#: where S3 and HTTP send a HEAD. test_remote_gcs.py checks the same on GCS its own way.
NOT_GCS = pytest.mark.parametrize("remote", ["http", "s3"], indirect=True)
