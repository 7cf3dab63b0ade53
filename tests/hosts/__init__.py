"""The hosts: trio, asyncio, blocking and Ray, and the words they share."""
