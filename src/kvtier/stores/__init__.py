"""The data plane's stores: dumb put/get/delete of block bytes with integrity checks. Policy lives in the directory."""
