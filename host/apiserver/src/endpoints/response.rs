//! Responses at the server's edge: objects as JSON, every error as a `Status`, and the
//! mapping of store errors to API errors, in one place.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_api::status::{StatusCause, StatusDetails};
use trellis_store::Error as StoreError;

/// An [`ApiError`] as an HTTP response.
#[derive(Debug)]
pub struct ErrorResponse(pub ApiError);

impl From<ApiError> for ErrorResponse {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.0.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = json_response(code, &self.0.to_status());
        if let Some(seconds) = self.0.details.as_ref().and_then(|d| d.retry_after_seconds) {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds),
            );
        }
        response
    }
}

pub type ApiResult<T = Response> = Result<T, ErrorResponse>;

/// A strategic merge patch that cannot be applied is the client's error: 400, with the
/// offending field as the cause.
impl From<crate::fieldmanager::patch::Error> for ApiError {
    fn from(e: crate::fieldmanager::patch::Error) -> Self {
        let cause = StatusCause::new("FieldValueInvalid", e.field(), e.to_string());
        Self {
            details: Some(Box::new(StatusDetails {
                causes: vec![cause],
                ..StatusDetails::default()
            })),
            ..ApiError::bad_request(format!(
                "the strategic merge patch could not be applied: {e}"
            ))
        }
    }
}

pub fn json_response(code: StatusCode, body: &Value) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_else(|_| b"{}".to_vec());
    let mut response = (code, bytes).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Maps a store error on `res`/`name` to what the client sees.
pub fn store_error(e: StoreError, res: &ResourceInfo, name: &str) -> ApiError {
    match e {
        StoreError::NotFound { .. } => ApiError::not_found(&res.group, &res.plural, name),
        StoreError::AlreadyExists { .. } => ApiError::already_exists(&res.group, &res.plural, name),
        StoreError::Conflict { .. } => {
            ApiError::conflict(&res.group, &res.plural, name, ApiError::MODIFIED)
        }
        StoreError::Compacted {
            requested,
            compacted,
        } => ApiError::gone(match compacted {
            Some(c) => format!("too old resource version: {requested} ({c})"),
            None => format!("too old resource version: {requested}"),
        }),
        StoreError::FutureRevision { requested, .. } => {
            ApiError::timeout(format!("Too large resource version: {requested}"))
        }
        StoreError::ValueTooLarge { size, limit, .. } => ApiError::new(
            413,
            trellis_api::status::Reason::RequestEntityTooLarge,
            format!("the object is {size} bytes, over the store's limit of {limit} bytes"),
        ),
        other => {
            tracing::error!(error = %error_chain(&other), resource = %res.qualified(), %name, "store request failed");
            ApiError::internal(other.to_string())
        }
    }
}

/// An error and its sources, `: `-separated.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}
