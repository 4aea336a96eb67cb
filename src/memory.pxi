# Memory: node-local allocation, mbind, migration and page-location queries.
