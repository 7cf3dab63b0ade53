"""The whole product as a user meets it: the command line, scenarios, the wire, kills, the README, packaging, layout."""
