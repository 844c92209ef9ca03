mod conformance;
mod crash;
mod redb;
