//! The Service writes that hold and release allocations: each Service is stored, updated
//! or deleted in one store transaction with its allocation keys, and the repair that
//! compares those keys with the stored Services.

use super::*;
use crate::state::AppState;

fn holder_value(obj: &Object) -> Bytes {
    let holder = alloc::Holder {
        namespace: meta_str(obj, "namespace").unwrap_or_default().to_owned(),
        name: object::name(obj).unwrap_or_default().to_owned(),
        uid: meta_str(obj, "uid").unwrap_or_default().to_owned(),
    };
    Bytes::from(serde_json::to_vec(&holder).unwrap_or_default())
}

/// What [`write`] stores: a new Service, or one replacing the revision `expected`.
enum Write {
    Create,
    Update(Revision),
}

/// Allocates what `obj` needs beyond `old`, then stores it with its claims (and the
/// release of what it no longer holds) in one transaction, picking again when a value
/// chosen here turns out taken. On any error `obj` is left as it came.
async fn write(
    state: &AppState,
    key: &str,
    obj: &mut Object,
    old: &Holdings,
    how: Write,
) -> ApiResult<trellis_store::Result<KeyValue>> {
    let allocators = &state.services;
    let original = obj.clone();
    let mut reloaded = false;
    for _ in 0..ALLOCATION_TRIES {
        *obj = original.clone();
        let claims = match allocators.assign(obj, old) {
            Ok(claims) => claims,
            Err(Some(e)) => {
                *obj = original;
                return Err(e.into());
            }
            Err(None) if !reloaded => {
                // Full as far as this server knows: others may have released values.
                reloaded = true;
                if let Err(e) = allocators.reload(state.store.as_ref()).await {
                    *obj = original;
                    return Ok(Err(e));
                }
                continue;
            }
            Err(None) => {
                let e = full_error(obj);
                *obj = original;
                return Err(e.into());
            }
        };
        let new = Holdings::of(obj);
        let released = Holdings {
            ips: old.ips.difference(&new.ips).copied().collect(),
            ports: old.ports.difference(&new.ports).copied().collect(),
        };
        let holder = holder_value(obj);
        let mut ops: Vec<TxnOp> = claims
            .iter()
            .map(|c| TxnOp::Create {
                key: c.key(),
                value: holder.clone(),
            })
            .collect();
        ops.extend(released.keys().into_iter().map(|key| TxnOp::Delete {
            key,
            expected: None,
        }));
        let value = object::encode(obj)?;
        ops.push(match how {
            Write::Create => TxnOp::Create {
                key: key.to_owned(),
                value,
            },
            Write::Update(expected) => TxnOp::Update {
                key: key.to_owned(),
                value,
                expected: Some(expected),
            },
        });
        match state.store.txn(ops).await {
            Ok(mut results) => {
                allocators.mark(&claims, &released);
                return match results.pop() {
                    Some(TxnResult::Put(kv)) => Ok(Ok(kv)),
                    _ => Err(
                        ApiError::internal("the store's transaction answered out of order").into(),
                    ),
                };
            }
            Err(trellis_store::Error::AlreadyExists { key: taken }) if taken != key => {
                let Some(claim) = claims.iter().find(|c| c.key() == taken) else {
                    *obj = original;
                    return Err(ApiError::internal(format!("allocation {taken} exists")).into());
                };
                allocators.mark(std::slice::from_ref(claim), &Holdings::default());
                if !matches!(
                    claim,
                    Claim::Ip { dynamic: true, .. } | Claim::Port { dynamic: true, .. }
                ) {
                    let e = taken_error(obj, claim);
                    *obj = original;
                    return Err(e.into());
                }
                // Another server allocates too: learn all it holds before picking again.
                if !reloaded {
                    reloaded = true;
                    if let Err(e) = allocators.reload(state.store.as_ref()).await {
                        *obj = original;
                        return Ok(Err(e));
                    }
                }
            }
            Err(e) => {
                *obj = original;
                return Ok(Err(e));
            }
        }
    }
    let e = full_error(&original);
    *obj = original;
    Err(e.into())
}

/// Stores a new Service at `key` with its ClusterIP and NodePorts, which it fills in.
/// The outer error is the client's (a value taken or outside its range, a range
/// full); the inner one the store's, as a plain create reports it.
pub async fn create(
    state: &AppState,
    key: &str,
    obj: &mut Object,
) -> ApiResult<trellis_store::Result<KeyValue>> {
    // As Kubernetes stores every new Service: an empty load balancer status.
    obj.entry("status")
        .or_insert_with(|| json!({"loadBalancer": {}}));
    write(state, key, obj, &Holdings::default(), Write::Create).await
}

/// What a dry run of a write shows: the values it would allocate filled in (none
/// reserved), an asked-for value that is taken or outside its range refused.
pub async fn dry_run(state: &AppState, obj: &mut Object, old: Option<&Object>) -> ApiResult<()> {
    let held = old.map(Holdings::of).unwrap_or_default();
    let original = obj.clone();
    let claims = match state.services.assign(obj, &held) {
        Ok(claims) => claims,
        Err(Some(e)) => return Err(e.into()),
        Err(None) => return Err(full_error(&original).into()),
    };
    for claim in claims.iter().filter(|c| {
        !matches!(
            c,
            Claim::Ip { dynamic: true, .. } | Claim::Port { dynamic: true, .. }
        )
    }) {
        let taken = state
            .store
            .get(&claim.key())
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if taken.is_some() {
            return Err(taken_error(&original, claim).into());
        }
    }
    Ok(())
}

/// An update of a Service (allocating and releasing with a change of type), or its
/// removal when `finalized` (the caller's `registry::finalized`); as
/// `registry::store_or_remove` does for others.
pub async fn store_or_remove(
    state: &AppState,
    res: &ResourceInfo,
    (namespace, name): (Option<&str>, &str),
    obj: &mut Object,
    expected: Revision,
    finalized: bool,
) -> ApiResult<(Revision, bool)> {
    let key = res.key(namespace, name);
    let current = state
        .store
        .get(&key)
        .await
        .map_err(|e| store_error(e, res, name))?
        .ok_or_else(|| ApiError::not_found(&res.group, &res.plural, name))?;
    if current.mod_revision != expected {
        return Err(ApiError::conflict(&res.group, &res.plural, name, ApiError::MODIFIED).into());
    }
    let old = crate::storage::watch_cache::decode_stored(&current.value, current.mod_revision)
        .ok_or_else(|| ApiError::internal(format!("stored object {key} is not a JSON object")))?;
    let held = Holdings::of(&old);
    if finalized {
        let deleted = remove(state, &key, &held, expected)
            .await
            .map_err(|e| store_error(e, res, name))?;
        return Ok((deleted.revision, true));
    }
    let kv = write(state, &key, obj, &held, Write::Update(expected))
        .await?
        .map_err(|e| store_error(e, res, name))?;
    Ok((kv.mod_revision, false))
}

/// Deletes the Service `obj` stored at `key` at revision `expected`, releasing what it
/// holds in the same transaction.
pub async fn delete(
    state: &AppState,
    key: &str,
    obj: &Object,
    expected: Revision,
) -> trellis_store::Result<Deleted> {
    remove(state, key, &Holdings::of(obj), expected).await
}

async fn remove(
    state: &AppState,
    key: &str,
    held: &Holdings,
    expected: Revision,
) -> trellis_store::Result<Deleted> {
    let mut ops: Vec<TxnOp> = held
        .keys()
        .into_iter()
        .map(|key| TxnOp::Delete {
            key,
            expected: None,
        })
        .collect();
    ops.push(TxnOp::Delete {
        key: key.to_owned(),
        expected: Some(expected),
    });
    let mut results = state.store.txn(ops).await?;
    state.services.mark(&[], held);
    match results.pop() {
        Some(TxnResult::Deleted(Some(deleted))) => Ok(deleted),
        _ => Err(trellis_store::Error::NotFound {
            key: key.to_owned(),
        }),
    }
}

/// What one repair pass changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Repaired {
    /// Allocation keys whose Service is gone, or no longer holds them: released.
    pub released: Vec<String>,
    /// Values stored Services hold whose keys were missing: recorded again.
    pub restored: Vec<String>,
}

/// One pass of the repair: reads the Services and the allocation keys at one
/// revision, releases the keys no Service holds and records the values Services hold
/// without a key, then reloads what this server believes taken.
pub async fn repair(state: &AppState) -> trellis_store::Result<Repaired> {
    let store = state.store.as_ref();
    let services = state
        .resource("", "v1", "services")
        .map(|r| r.prefix())
        .unwrap_or_else(|_| "/registry/core/services/".to_owned());
    let revision = store.current_revision().await?;
    let listed = list_all(store, &services, Some(revision)).await?;
    let mut wanted: std::collections::BTreeMap<String, Bytes> = Default::default();
    for kv in &listed {
        let Some(obj) = crate::storage::watch_cache::decode_stored(&kv.value, kv.mod_revision)
        else {
            continue;
        };
        let value = holder_value(&obj);
        for key in Holdings::of(&obj).keys() {
            if let Some(other) = wanted.insert(key.clone(), value.clone())
                && other != value
            {
                tracing::warn!(allocation = %key, "two Services hold the same allocation; recreate one of them");
            }
        }
    }
    let mut present = list_all(store, alloc::IP_PREFIX, Some(revision)).await?;
    present.extend(list_all(store, alloc::NODE_PORT_PREFIX, Some(revision)).await?);
    let mut repaired = Repaired::default();
    let present_keys: BTreeSet<&str> = present.iter().map(|kv| kv.key.as_str()).collect();
    for kv in &present {
        if wanted.contains_key(&kv.key) {
            continue;
        }
        // At the revision read: if the key changed since, someone holds it again.
        match store
            .txn(vec![TxnOp::Delete {
                key: kv.key.clone(),
                expected: Some(kv.mod_revision),
            }])
            .await
        {
            Ok(_) => repaired.released.push(kv.key.clone()),
            Err(trellis_store::Error::Conflict { .. } | trellis_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    for (key, value) in &wanted {
        if present_keys.contains(key.as_str()) {
            continue;
        }
        match store.create(key, value.clone()).await {
            Ok(_) => repaired.restored.push(key.clone()),
            Err(trellis_store::Error::AlreadyExists { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    state.services.reload(store).await?;
    if !repaired.released.is_empty() || !repaired.restored.is_empty() {
        tracing::info!(released = ?repaired.released, restored = ?repaired.restored, "repaired Service allocations");
    }
    Ok(repaired)
}

/// Repairs once now, then every `interval` until `stopped`.
pub async fn start_repair(
    state: std::sync::Arc<AppState>,
    stopped: trellis_api::Shutdown,
) -> trellis_store::Result<()> {
    repair(&state).await?;
    let interval = state.settings.service_repair_interval;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stopped.wait() => return,
                () = tokio::time::sleep(interval) => {}
            }
            if let Err(e) = repair(&state).await {
                tracing::warn!(error = %e, "repairing Service allocations failed");
            }
        }
    });
    Ok(())
}
